"""Gathered weights kept for a whole step: one all-gather per parameter per optimizer step.

In a step of several backwards every forward would gather every weight again; with this, the first forward's
gather is kept until the step's last backward, so the step's all-gathers do not grow with its microbatches, at
the cost of the rank's gathered weights held for the step (`planning.memory` counts it; `auto` keeps them only
where the plan fits comfortably).

    keep_for_step(model)        at build time: no reshard-after-forward; FSDP2: `set_reshard_after_forward(False)`
    kept_gathers(model)         around a step's backwards (SimpleFSDP): the step-scoped cache

SimpleFSDP hands out each kept tensor (`hand_out`) through a function whose backward routes the gradient as the
plain gather would; compiled graphs read the kept weights as inputs. FSDP2 keeps its own unsharded parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from titanlite.parallelisms.data_parallel.eager_reshard import set_reshard_after_forward
from titanlite.parallelisms.data_parallel.replicate_compute import ReduceToShard, ReplicateComputation, RouteGradient
from titanlite.parallelisms.data_parallel.simple_fsdp import parametrized


def keep_for_step(model: nn.Module) -> None:
    """Turn reshard-after-forward off everywhere in `model`: weights are kept for the step instead."""
    roots = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if roots:
        roots[0].set_reshard_after_forward(False)  # recurses into every block
    set_reshard_after_forward(model, False)


def hand_out(gather: ReplicateComputation, x: DTensor) -> torch.Tensor:
    """`gather`'s weight for this forward, from its kept gather (`ReplicateComputation.forward` calls it
    inside `kept_gathers`). Under torch.compile this is what a block's graph traces: the kept weight is a
    graph input, so the graph holds no all-gather, and one function (never a per-step object) is what
    Dynamo guards on, so later steps reuse the graph."""
    full = gather.kept
    if not (x.requires_grad and torch.is_grad_enabled()):
        return gather._as_tp(full)
    if gather.state.unreduced:
        return gather._as_tp(RouteGradient.apply(full, gather.sink))
    return gather._as_tp(ReduceToShard.apply(full, x, gather))


@contextlib.contextmanager
def kept_gathers(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Inside, every SimpleFSDP gather of `model` that takes gradients is made once, on entering, and
    handed out by `hand_out`; leaving frees them all. Gathering on entry (rather than at first use) is
    what lets compiled blocks use the kept weights: their graphs read them as inputs."""
    pairs = parametrized(model) if enabled else []
    try:
        for gather, param in pairs:
            gather.kept = gather.gathered(param)  # (without autograd)
            gather.step_cache = hand_out
        yield
    finally:
        for gather, _ in pairs:
            gather.step_cache = None
            gather.kept = None
