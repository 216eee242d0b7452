"""The step runner: the loss and the gradients of one step, the one way training and validation call the
model. `Trainer.train_step` adds agreement across ranks and the update.

    StepRunner                        what the trainer and the validator call (two implementations)
    LocalRunner(model, device, ctx)   the whole model on this rank, called once per microbatch
    pipeline.PipelineRunner           this rank's pipeline stages, run by torch's schedule

Both run inside the one `StepContext` (`parallelisms/step_context.py`): the same loss and loss scope
(loss parallel; the hook for context parallelism), the same gradient reduction over the step's
backwards, the same clipping.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.config import JobConfig
from titanlite.optim import clip_grad_norm_
from titanlite.parallelisms.step_context import LossFn, StepContext, replicated

Batch = tuple[torch.Tensor, torch.Tensor]
"""(inputs, labels) of one microbatch, token ids [batch, seq], on the host."""


def cross_entropy_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy, computed in fp32."""
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


def training_loss_fn(cfg: JobConfig) -> LossFn:
    """The loss training and validation use: cross-entropy, compiled when `compile.components` has `loss`."""
    if cfg.compile.enable and "loss" in cfg.compile.components:
        return torch.compile(cross_entropy_loss, backend=cfg.compile.backend)
    return cross_entropy_loss


class StepRunner(Protocol):
    """Runs the model for a step or an evaluation; the trainer and the validator know only this."""

    model: nn.Module
    """This rank's module (its pipeline stages as one, under pipeline parallelism)."""
    context: StepContext
    device: torch.device

    def forward_backward(
        self, optimizer: torch.optim.Optimizer, batches: list[Batch], context: StepContext | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradients of the rank's batch (the step's accumulation batches), clipped; returns (the rank's
        mean loss, the global grad norm). The optimizer step is separate so the caller can skip it
        (non-finite loss, stop signal). `context` replaces the runner's for this step."""
        ...

    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss of one held-out batch (the caller runs it under `no_grad`), a plain tensor."""
        ...


class LocalRunner:
    """The step of a model held whole by this rank (data and tensor parallelism included)."""

    def __init__(self, model: nn.Module, device: torch.device, context: StepContext) -> None:
        self.model, self.device, self.context = model, device, context

    def _loss(self, inputs: torch.Tensor, labels: torch.Tensor, ctx: StepContext, backwards: int) -> torch.Tensor:
        # Pinned host batches (the loader pins them on CUDA) copy without blocking the host.
        inputs, labels = inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
        return ctx.microbatch_loss(self.model(inputs), labels, backwards, self.model)

    def forward_backward(
        self, optimizer: torch.optim.Optimizer, batches: list[Batch], context: StepContext | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each microbatch's loss is divided by their count, so the accumulated gradient is that of the
        mean over the rank's whole batch; SimpleFSDP/FSDP2 then average it over the data-parallel ranks
        (once per step or per microbatch, as the context's policy says)."""
        ctx = context or self.context
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        n = len(batches)
        with ctx.reduction(self.model, n) as before_backward:
            for i, (inputs, labels) in enumerate(batches):
                with ctx.loss_scope():
                    loss = self._loss(inputs, labels, ctx, n)
                    before_backward(i == n - 1)
                    loss.backward()
                total += replicated(loss).detach()
        grad_norm = clip_grad_norm_(list(self.model.parameters()), ctx.max_norm)
        return total, grad_norm

    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        inputs, labels = inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
        with self.context.loss_scope():
            return replicated(self.context.loss_fn(self.model(inputs), labels))
