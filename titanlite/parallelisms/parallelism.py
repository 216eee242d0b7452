"""What one parallelism is: a unit of four parts, each read by the one place that needs it.

    rules       `(cfg, dims, spec, args) -> None`, raising `ConfigError` with one line: what the parallelism
                needs from the other keys, the model family and the mesh. The run plan (`plan.RunPlan.build`)
                calls it before any rank starts, for each parallelism whose degree is above one.
    apply       `(ApplyArgs) -> own meshes`: the parallelism applied to the model on the meta device. The
                framework's order (`parallelize.PARALLELISMS`) calls it; it returns the modules the data-parallel
                plan must place on a mesh of their own (expert parallelism's experts), else nothing.
    step_hook   `(dims) -> StepHook | None`: what it changes in a training step, a microbatch's per-token
                tensors (`StepHook.batch`) and its loss (`StepHook.loss`), applied by the one step context
                (`step_context.StepContext`) that both step runners and validation use.
    step_time   `(StageWork) -> seconds`: its exposed collectives for one microbatch through one pipeline
                stage, read by the step-time model (`planning/step_time.py`) for the dry run and the layout
                search; `group` names its ranks' mesh group (size, stride in ranks) for the link it runs on,
                and `comm_words` what the search calls that term when it compares two layouts.

A parallelism is adding this unit in its own module, its setting in `config/schema.py` and its place in the
order; the plan, the step context and the step-time model read it from the order and name none of them.
The memory a parallelism changes is the family's activation model's (`ModelSpec.planning.activation_bytes`, from
the `memory_plan.Layout` the run plan fills), since what it saves depends on the family's shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from titanlite.config import JobConfig
from titanlite.parallelisms.parallel_dims import ParallelDims

if TYPE_CHECKING:  # the run plan reads the units' rules in the launcher, which imports no DTensor
    from titanlite.parallelisms.data_parallel.simple_fsdp import DataParallelMesh
    from titanlite.parallelisms.host_replay import HostReplay
    from titanlite.parallelisms.units import Units


class StepHook(Protocol):
    """A parallelism's part of a training step (module docstring: step_hook)."""

    def batch(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of a per-token tensor of a microbatch ([batch, seq]: inputs, labels)."""
        ...

    def loss(self, loss: torch.Tensor) -> torch.Tensor:
        """A microbatch's loss as its backward runs on it."""
        ...


@dataclass(frozen=True)
class ApplyArgs:
    """What an apply function is given: the model on the meta device and everything about the run."""

    model: nn.Module
    units: Units
    tp_plan: Any
    """The family's `tensor_parallel.TensorParallelPlanFn`, or None (the family has none)."""
    dims: ParallelDims
    cfg: JobConfig
    replay: HostReplay
    """Host values the blocks' forwards read, replayed by full activation checkpointing's recompute."""


@dataclass(frozen=True)
class StageWork:
    """One microbatch through one pipeline stage (or the whole model), as the step-time model counts it."""

    blocks: int
    """Blocks the stage holds."""
    full: int
    """Of those, fully checkpointed (recomputed whole in backward)."""
    selective: int
    """Of those, selectively checkpointed (`op`, `op_all_mm`)."""
    first: bool
    last: bool
    microbatch: int
    """Samples of the microbatch."""
    seq_len: int
    tokens: int
    """Tokens of the microbatch a rank holds (microbatch x seq_len / cp)."""
    itemsize: int
    """Bytes per element of the compute dtype."""
    tp: int
    cost: Any
    """The family's `models.cost.ModelCost`."""
    features: Any
    """The step-time model's `Features` (techniques compared with, not run)."""
    ring: Callable[[float], float]
    """Seconds of an all-gather or reduce-scatter of that many unsharded bytes over this unit's group."""


Rules = Callable[[JobConfig, ParallelDims, Any, Any], None]
"""`(cfg, dims, spec, args)`: the config, the mesh degrees, the family's `ModelSpec` and its model args."""


def _no_hook(dims: ParallelDims) -> StepHook | None:
    return None


@dataclass(frozen=True)
class ParallelismUnit:
    """One parallelism (module docstring)."""

    name: str
    degree: Callable[[ParallelDims], int]
    """Its degree in the mesh; above one, it is on."""
    rules: Rules
    apply: Callable[[ApplyArgs], dict[nn.Module, DataParallelMesh]]
    step_hook: Callable[[ParallelDims], StepHook | None] = _no_hook
    step_time: Callable[[StageWork], float] | None = None
    group: Callable[[ParallelDims], tuple[int, int]] | None = None
    """(ranks, stride in ranks) of its group in the mesh, innermost dims fastest; with `step_time`."""
    comm_words: str = ""
    """What its `step_time` term counts, in the layout search's words (`exposed tp collectives`); with
    `step_time`."""

    def enabled(self, dims: ParallelDims) -> bool:
        return self.degree(dims) > 1
