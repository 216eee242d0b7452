"""What a training step runs inside, whoever runs the model: the one loss context and the one
gradient-reduction context, shared by both step runners (`step.LocalRunner` and `pipeline.PipelineRunner`).

- The loss of a microbatch: `loss_fn(pred, labels)` plus the family's extra term, scaled over the step's
  backwards, under `loss_parallel` when tensor parallelism keeps the logits vocab-sharded.
- Each parallelism's step hook (`parallelism.StepHook`, `parallelize.step_hooks`): its work before a step, its
  part of a microbatch's per-token tensors, its view of the loss (context parallelism's shards).
- The reduction: `gradient_reduction.reduce_once` with the step's policy; clipping by the global norm.

It lives under `parallelisms/` because the pipeline runner uses it and sits below the step module.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import loss_parallel

from titanlite.parallelisms.data_parallel.gradient_reduction import reduce_once
from titanlite.parallelisms.parallelism import StepHook

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""`loss_fn(pred, labels)`: the mean loss of one microbatch's logits against its labels."""
ExtraLoss = Callable[[nn.Module], torch.Tensor]
"""`extra_loss(model)`: a family's extra term of the forward that just ran (`ModelSpec.hooks.extra_loss`)."""


@dataclass(frozen=True)
class StepContext:
    """The step's loss and reduction, the same for every runner."""

    loss_fn: LossFn
    loss_parallel: bool = False
    """The logits are vocab-sharded (tensor parallelism with loss parallel): the loss runs under
    `loss_parallel`."""
    max_norm: float = 0.0
    """Clip the gradients to this global norm; 0: no clipping (the norm is still returned)."""
    reduce_once: bool = True
    """Reduce the gradients once per step, after its last backward (else per backward)."""
    keep_gathers: bool = False
    """Gather the weights once per step, for all of its microbatches."""
    extra_loss: ExtraLoss | None = None
    """Added to each training microbatch's loss (`ModelSpec.hooks.extra_loss`); not to validation's."""
    hooks: tuple[StepHook, ...] = ()
    """The step hooks of the parallelisms the mesh runs, in their order (`parallelize.step_hooks`)."""
    across_replicas: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
    """`(model, loss) -> loss`: the gradients and the loss averaged over the job's replica groups, after the
    reduction and before clipping (`fault_tolerance.ReplicaGroup.average`); None: one group."""

    def before_step(self, model: nn.Module) -> None:
        """What the step hooks do before a step's (or an evaluation's) first forward, with `model` (this
        rank's model, or one of its pipeline stages)."""
        for hook in self.hooks:
            hook.before_step(model)

    def held(self, seq_len: int, device: torch.device) -> torch.Tensor | None:
        """The indices in a `seq_len`-token sequence of the tokens `shard` keeps, or None for all of them
        (`StepHook.held`; context parallelism: the forward's positions and its mask's query rows)."""
        held: torch.Tensor | None = None
        for hook in self.hooks:
            kept = hook.held(seq_len if held is None else held.numel(), device)
            if kept is not None:
                held = kept if held is None else held[kept]
        return held

    def with_loss(self, loss_fn: LossFn) -> StepContext:
        """The same context with another loss (a test's injected fault)."""
        return dataclasses.replace(self, loss_fn=loss_fn)

    def with_replicas(self, average: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> StepContext:
        """The same context, its gradients averaged over the job's replica groups (`across_replicas`)."""
        return dataclasses.replace(self, across_replicas=average)

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a per-token tensor of a microbatch ([batch, seq]: inputs, labels): all of
        them, or what the step hooks keep (its part of every sequence under context parallelism)."""
        for hook in self.hooks:
            t = hook.batch(t)
        return t

    def loss_scope(self) -> contextlib.AbstractContextManager:
        """Where a microbatch's forward-to-loss and its backward run (training and validation alike)."""
        return loss_parallel() if self.loss_parallel else contextlib.nullcontext()

    def microbatch_loss(
        self, pred: torch.Tensor, labels: torch.Tensor, backwards: int, model: nn.Module | None = None
    ) -> torch.Tensor:
        """One microbatch's share of the step's loss: its loss plus the extra term of `model` (the module
        whose forward just ran), as the step hooks see it, over the step's `backwards`."""
        loss = self.loss_fn(pred, labels)
        if self.extra_loss is not None:
            assert model is not None, "the extra loss term needs the module whose forward ran"
            extra = self.extra_loss(model)
            if isinstance(loss, DTensor) and not isinstance(extra, DTensor):
                # A loss-parallel loss is replicated over tp; the family's term, computed alike on every tp
                # rank, joins it as replicated too (its backward then hands the term a plain gradient).
                mesh = loss.device_mesh
                extra = DTensor.from_local(extra, mesh, [Replicate()] * mesh.ndim, run_check=False)
            loss = loss + extra
        for hook in self.hooks:
            loss = hook.loss(loss)
        return loss / backwards

    def reduction(
        self, model: nn.Module, backwards: int, pipelined: bool = False
    ) -> contextlib.AbstractContextManager[Callable[[bool], None]]:
        """The step's `backwards` run inside; call the yielded `before_backward(last)` before each (a
        pipeline schedule's backwards are torch's: `pipelined`, and the reduction is given their count,
        since no caller marks the last one). The policy applies only to a step of several backwards."""
        several = backwards > 1
        return reduce_once(
            model,
            self.reduce_once and several,
            pipelined=pipelined,
            keep=self.keep_gathers and several,
            backwards=backwards if pipelined else 0,
        )


def replicated(loss: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor: a vocab-parallel loss is a replicated DTensor, equal on the tp ranks."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
