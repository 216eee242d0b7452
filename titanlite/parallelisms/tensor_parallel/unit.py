"""Tensor parallelism from a family's plan: which module is split how, as data the framework applies.

A family states its plan as a `TensorParallelStyles` (torch's `ParallelStyle`s by module name, for the
root modules and for every block alike); `apply_tp` applies it with `parallelize_module`. The family
never calls torch's tensor-parallel API itself, so the order of the parallelisms stays in one place
(`parallelize.py`) and a family without a plan is refused with a tensor-parallel degree above one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titanlite.config import JobConfig
from titanlite.errors import ConfigError
from titanlite.parallelisms.parallel_dims import ParallelDims
from titanlite.parallelisms.parallelism import ApplyArgs, ParallelismUnit, StageWork, when_on
from titanlite.parallelisms.units import Units

if TYPE_CHECKING:  # DTensor is imported where a plan is applied: the run plan reads this unit's rules in
    # the launcher, before any rank, which imports no DTensor (a second of every launch)
    from torch.distributed.tensor.parallel import ParallelStyle


@dataclass(frozen=True)
class TensorParallelStyles:
    """One model's tensor-parallel layout: module name -> torch `ParallelStyle`."""

    roots: dict[str, ParallelStyle]
    """Root modules (`Units.before`/`after`), by name; a pipeline stage layouts only those it holds."""
    block: dict[str, ParallelStyle]
    """Submodules of one block, by name relative to the block; the same plan for every block (an entry
    naming a module a block does not have is skipped there: a MoE family's dense and MoE blocks share
    one plan)."""


TensorParallelStylesFn = Callable[[bool], TensorParallelStyles]
"""A family's plan, given `loss_parallel` (True: the output projection keeps its logits vocab-sharded,
for a loss run under `torch.distributed.tensor.parallel.loss_parallel`)."""


def apply_tp(model: nn.Module, units: Units, plan: TensorParallelStyles, tp_mesh: DeviceMesh) -> None:
    """Split `model`'s modules over `tp_mesh` as `plan` says, in place. Root modules a pipeline stage
    does not hold (set to None) are skipped."""
    from torch.distributed.tensor.parallel import parallelize_module

    children = dict(model.named_children())  # without the roots a stage set to None
    held = {name: style for name, style in plan.roots.items() if name in children}
    if held:
        parallelize_module(model, tp_mesh, held)
    for block in units.blocks.values():
        parallelize_module(block, tp_mesh, {name: style for name, style in plan.block.items() if _has(block, name)})


def _has(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def check_tensor_parallel(cfg: JobConfig, dims: ParallelDims, spec: Any, args: Any) -> None:
    """What tensor parallelism needs beyond the mesh's own rule (tp divides the family's sizes:
    `ParallelDims`): a family with a plan, and a sequence its ranks split evenly (sequence parallelism holds
    the hidden states between the blocks sequence-sharded, and pipeline stages pass them so; an uneven split
    ends in the collectives' size mismatch on a rank)."""
    if spec.parallel.tp_styles is None:
        raise ConfigError(f"model {cfg.model.name} has no tensor-parallel styles: set tensor_parallel_degree 1")
    seq_len = cfg.training.seq_len
    local = seq_len // dims.cp  # the positions a rank holds (context parallelism's own rule: cp divides)
    if dims.tp_enabled and local % dims.tp:
        held = f"training.seq_len {seq_len}"
        if dims.cp > 1:
            held = f"the {local} positions of a context-parallel rank (training.seq_len {seq_len} / {dims.cp})"
        raise ConfigError(
            f"{held} is not a multiple of tensor_parallel_degree {dims.tp} (sequence parallelism splits each "
            "sequence over the tp ranks)"
        )


def step_time(work: StageWork) -> float:
    """The hidden-state all-gathers and reduce-scatters of sequence parallelism (`ModelCost.block`'s
    `tp_collectives` per block and pass: forward, backward, and the forward again under full AC; selective
    AC repeats `tp_recomputed_selective`), two more around the embedding and two around the output; exposed,
    since they sit between the matmuls that need them (unless async TP, compared with only, hides them)."""
    coll = 0.0 if work.features.async_tp else work.ring(work.tokens * work.cost.hidden * work.itemsize)
    b = work.cost.block
    n = b.tp_collectives * (2 * work.blocks + work.full) + b.tp_recomputed_selective * work.selective
    if work.last:
        n += 2
    if work.first:
        n += 2
    return n * coll


def _apply(a: ApplyArgs) -> dict:
    """First: it replaces parameters with DTensors on the tp mesh, which data parallelism shards further."""
    assert a.tp_styles is not None, "RunPlan.build refuses tensor parallelism for a family without TP styles"
    assert a.dims.tp_mesh is not None
    apply_tp(a.model, a.units, a.tp_styles(a.dims.loss_parallel), a.dims.tp_mesh)
    return {}


def _on(cfg: JobConfig, dims: ParallelDims) -> bool:
    return dims.tp_enabled


UNIT = ParallelismUnit(
    name="tensor",
    on=_on,
    rules=when_on(_on, check_tensor_parallel),
    apply=_apply,
    step_time=step_time,
    group=lambda dims: (dims.tp, 1),
    comm_words="exposed tp collectives",
)
"""Tensor parallelism as one unit (`parallelism.ParallelismUnit`)."""
