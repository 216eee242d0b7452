"""The loss and the gradients of one step; `Trainer.train_step` adds agreement across ranks and the update."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from titanlite.optim import clip_grad_norm_
from titanlite.parallelisms.gradient_reduction import reduce_once


def cross_entropy_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy, computed in fp32."""
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


def loss_context(use_loss_parallel: bool) -> contextlib.AbstractContextManager:
    """Where the loss (and its backward) must run: inside `loss_parallel` when the logits are vocab-sharded."""
    return loss_parallel() if use_loss_parallel else contextlib.nullcontext()


def forward_loss(model, inputs, labels, loss_fn, device: torch.device) -> torch.Tensor:
    """The loss of one microbatch, the one model call of training and validation (inside `loss_context`);
    a pipeline schedule would replace this call for both."""
    # Pinned host batches (the loader pins them on CUDA) copy without blocking the host.
    inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
    return loss_fn(model(inputs), labels)


def replicated(loss: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor: a vocab-parallel loss is a replicated DTensor, equal on the tp ranks."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def forward_backward(
    model,
    optimizer,
    batches,
    loss_fn,
    use_loss_parallel: bool,
    max_norm: float,
    device: torch.device,
    per_step_reduction: bool = True,
    keep_gathers: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of the rank's batch, clipped; returns (local mean loss, global grad norm).

    The loss of each microbatch is divided by their count, so the accumulated gradient is that of the
    mean over the rank's whole batch; SimpleFSDP/FSDP2 then average it over the data-parallel ranks.
    With `per_step_reduction` they reduce once, after the last microbatch; with `keep_gathers` the
    weights are gathered once for all microbatches (`gradient_reduction.StepPolicy`).
    The optimizer step is separate so the caller can skip it (non-finite loss, preemption).
    """
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=device)
    several = len(batches) > 1
    with reduce_once(model, per_step_reduction and several, keep=keep_gathers and several) as before_backward:
        for i, (inputs, labels) in enumerate(batches):
            with loss_context(use_loss_parallel):
                loss = forward_loss(model, inputs, labels, loss_fn, device) / len(batches)
                before_backward(i == len(batches) - 1)
                loss.backward()
            total += replicated(loss).detach()
    grad_norm = clip_grad_norm_(list(model.parameters()), max_norm)
    return total, grad_norm
