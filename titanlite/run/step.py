"""The step runner: the loss and the gradients of one step, the one way training and validation call the
model. `Trainer.train_step` adds agreement across ranks and the update.

    StepRunner                        what the trainer and the validator call (two implementations)
    LocalRunner(model, device, ctx)   the whole model on this rank, called once per microbatch
    pipeline.PipelineRunner           this rank's pipeline stages, run by torch's schedule

Both run inside the one `StepContext` (`parallelisms/step_context.py`): the same loss and loss scope
(loss parallel), the same batch and the same work before a step (the parallelisms' step hooks: under
context parallelism the rank's part of every sequence), the same gradient reduction over the step's
backwards, the same clipping.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.config import JobConfig
from titanlite.data.batch import Batch
from titanlite.models.common.attention import AttnMaskType, build_mask, causal_mask
from titanlite.parallelisms.clipping import clip_grad_norm_
from titanlite.parallelisms.step_context import LossFn, StepContext, replicated


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

    def evaluate(self, batch: Batch) -> torch.Tensor:
        """The loss of one held-out batch (the caller runs it under `no_grad`), a plain tensor."""
        ...


def model_forward(
    model: nn.Module, batch: Batch, mask_type: AttnMaskType, context: StepContext | None = None
) -> torch.Tensor:
    """The model's output for one batch already on its device. Under `block_causal` the batch's positions
    go to RoPE and its document mask is built here, once for every block and outside any compiled code
    (`models/common/attention.py`); under `causal` the model sees the tokens alone. Where the step hooks of
    `context` keep part of every sequence (`StepContext.held`: context parallelism) the model sees those
    tokens: the mask is that of their global indices against every key (causal: one document per row) and
    RoPE takes their positions (causal: their global indices); its labels are `StepContext.shard(labels)`."""
    rows, seq = batch.inputs.shape
    held = context.held(seq, batch.inputs.device) if context is not None else None
    if held is None:
        if mask_type == "causal":
            return model(batch.inputs)
        return model(batch.inputs, positions=batch.positions, mask=build_mask(mask_type, batch.positions))
    assert context is not None
    if mask_type == "causal":
        positions, mask = held.expand(rows, -1), causal_mask(rows, seq, held)
    else:
        positions, mask = context.shard(batch.positions), build_mask("block_causal", batch.positions, q_index=held)
    return model(context.shard(batch.inputs), positions=positions, mask=mask)


class LocalRunner:
    """The step of a model held whole by this rank (data and tensor parallelism included); `mask_type` is
    `model.attn_mask_type`."""

    def __init__(
        self, model: nn.Module, device: torch.device, context: StepContext, mask_type: AttnMaskType = "causal"
    ) -> None:
        self.model, self.device, self.context, self.mask_type = model, device, context, mask_type

    def _loss(self, batch: Batch, ctx: StepContext, backwards: int) -> torch.Tensor:
        batch = batch.to(self.device, positions=self.mask_type != "causal")
        pred = model_forward(self.model, batch, self.mask_type, ctx)
        return ctx.microbatch_loss(pred, ctx.shard(batch.labels), backwards, self.model)

    def forward_backward(
        self, optimizer: torch.optim.Optimizer, batches: list[Batch], context: StepContext | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each microbatch's loss is divided by their count, so the accumulated gradient is that of the
        mean over the rank's whole batch; SimpleFSDP/FSDP2 then average it over the data-parallel ranks
        (once per step or per microbatch, as the context's policy says), and replica groups over the job's
        groups (`StepContext.across_replicas`)."""
        ctx = context or self.context
        optimizer.zero_grad(set_to_none=True)
        ctx.before_step(self.model)
        total = torch.zeros((), device=self.device)
        n = len(batches)
        with ctx.reduction(self.model, n) as before_backward:
            for i, batch in enumerate(batches):
                with ctx.loss_scope():
                    loss = self._loss(batch, ctx, n)
                    before_backward(i == n - 1)
                    loss.backward()
                total += replicated(loss).detach()
        if ctx.across_replicas is not None:
            total = ctx.across_replicas(self.model, total)
        grad_norm = clip_grad_norm_(list(self.model.parameters()), ctx.max_norm)
        return total, grad_norm

    def evaluate(self, batch: Batch) -> torch.Tensor:
        batch = batch.to(self.device, positions=self.mask_type != "causal")
        self.context.before_step(self.model)
        with self.context.loss_scope():
            pred = model_forward(self.model, batch, self.mask_type, self.context)
            return replicated(self.context.loss_fn(pred, self.context.shard(batch.labels)))
