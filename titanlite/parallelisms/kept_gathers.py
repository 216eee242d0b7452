"""Gathered weights kept for a whole step: one all-gather per parameter per optimizer step.

A step of several backwards (gradient accumulation, pipeline microbatches) runs the forward once per
microbatch. Without this, every forward gathers every weight again (and reshard-after-forward gathers
it once more in backward); with it, the first forward's gather is kept until the step's last backward
and every later use reads it, so the step's all-gathers do not grow with its microbatches. The cost
is the rank's gathered weights, in the compute dtype, for the whole step; `memory_plan` counts it and
`parallelism.fsdp_reshard_after_forward = "auto"` keeps them only where the plan fits comfortably.

    keep_for_step(model)        at build time: no reshard-after-forward (the kept weight is what
                                backward uses); FSDP2: `set_reshard_after_forward(False)`
    kept_gathers(model)         around a step's backwards (SimpleFSDP): the step-scoped cache

SimpleFSDP (eager): each `ReplicateComputation` asks its `step_cache` first. The cache gathers once
without autograd and hands out the kept tensor through a function whose backward routes the gradient
as the plain gather would: into the unreduced sink (`gradient_reduction` per_step) or through a
reduce-scatter (all-reduce for replicate dims) to the sharded parameter (per_microbatch). FSDP2 keeps
its own unsharded parameters: reshard-after-backward is off for all but the last backward
(`gradient_reduction.reduce_once`; under pipeline parallelism torch's pipeline stage does this itself).
Compiled SimpleFSDP blocks gather inside their graphs, so they are not kept (`step_candidates`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from titanlite.parallelisms.eager_reshard import set_reshard_after_forward
from titanlite.parallelisms.replicate_compute import ReplicateComputation, RouteGradient


def keep_for_step(model: nn.Module) -> None:
    """Turn reshard-after-forward off everywhere in `model`: weights are kept for the step instead."""
    roots = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if roots:
        roots[0].set_reshard_after_forward(False)  # recurses into every block
    set_reshard_after_forward(model, False)


class StepCache:
    """The weights gathered in this step, by gather module; `ReplicateComputation.forward` calls it."""

    def __init__(self) -> None:
        self.full: dict[ReplicateComputation, torch.Tensor] = {}

    def __call__(self, gather: ReplicateComputation, x: DTensor) -> torch.Tensor:
        full = self.full.get(gather)
        if full is None:
            with torch.no_grad():
                full = self.full[gather] = gather._gather_local(x)
        if not (x.requires_grad and torch.is_grad_enabled()):
            return gather._as_tp(full)
        if gather.state.unreduced:
            return gather._as_tp(RouteGradient.apply(full, gather.sink))
        return gather._as_tp(_ReduceToShard.apply(full, x, gather))


class _ReduceToShard(torch.autograd.Function):
    """Identity on a kept weight; backward reduces its gradient to the sharded parameter `x`, as the
    gather's own backward does: cast to the reduce dtype, averaged over the data-parallel dims
    (reduce-scatter on a sharded dim, all-reduce on a replicated one), cast back to `x`'s dtype."""

    @staticmethod
    def forward(ctx: Any, full: torch.Tensor, x: DTensor, gather: ReplicateComputation) -> torch.Tensor:
        ctx.gather = gather
        ctx.meta = (x.device_mesh, x.placements, x.shape, x.stride(), x.dtype)
        return full.view_as(full)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, DTensor, None]:
        gather: ReplicateComputation = ctx.gather
        mesh, placements, shape, stride, dtype = ctx.meta
        grad = grad.to(gather.mp.reduce_dtype or dtype)
        partial = DTensor.from_local(
            grad, gather.dp_mesh, gather.grad_placements, run_check=False, shape=grad.shape, stride=grad.stride()
        )
        local = partial.redistribute(gather.dp_mesh, gather.dp_placements).to_local().to(dtype)
        return None, DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride), None


@contextlib.contextmanager
def kept_gathers(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Inside, every SimpleFSDP gather of `model` is made once and kept; leaving frees them all."""
    gathers = [m for m in model.modules() if isinstance(m, ReplicateComputation)] if enabled else []
    cache = StepCache()
    for gather in gathers:
        gather.step_cache = cache
    try:
        yield
    finally:
        for gather in gathers:
            gather.step_cache = None
        cache.full.clear()
