"""What one parallelism is: a unit of parts, each read by the one place that needs it.

    on          `(cfg, dims) -> bool`: whether the run has it (a mesh degree above one, or a config switch)
    rules       `(cfg, dims, spec, args) -> None`, raising one-line `ConfigError`s; the run plan calls it
                for every unit before any rank starts; `check_device`: those that need the ranks' device
    apply       `(ApplyArgs) -> own meshes`: applied to the model on the meta device, in its phase of the
                framework's order (`parallelize.PARALLELISMS`); `gathers` changes how weights are gathered
    step_hook   `(dims) -> StepHook | None`: what it changes in a training step (`step_context.StepContext`)
    stages      `Stages`: the plan, cut, runner and union of a parallelism that cuts the model into stages
    sharded_view  `(model) -> context`: the weights it re-parametrizes read as stored (a state dict's view)
    step_policies  `StepPolicies`: which `step_policy.StepPolicy` a run allows and what the chosen one
                changes in the model, for a parallelism that holds state across a step's backwards
    step_time   `(StageWork) -> seconds`: its exposed collectives, for the step-time model; `group` and
                `comm_words` name its mesh group and that term

A parallelism is its folder with this unit, its setting and its place in the order; the plan, the build and
the step name none of them (`tests/unit/parallelisms/test_parallelism_unit.py` lists who else imports each
folder, and why).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from titanlite.config import JobConfig
from titanlite.parallelisms.parallel_dims import ParallelDims
from titanlite.parallelisms.step_policy import StepPolicy

if TYPE_CHECKING:  # the run plan reads the units' rules in the launcher, which imports no DTensor
    from titanlite.parallelisms.host_replay import HostReplay
    from titanlite.parallelisms.units import Units


class StepHook:
    """A parallelism's part of a training step; each method's default leaves the step as it is."""

    def before_step(self, model: nn.Module) -> None:
        """Before a step's (or an evaluation's) first forward, with this rank's model (float8's gathers
        refreshed from the weights as they are now)."""

    def batch(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of a per-token tensor of a microbatch ([batch, seq]: inputs, labels, positions)."""
        return t

    def held(self, seq_len: int, device: torch.device) -> torch.Tensor | None:
        """The indices in a `seq_len`-token sequence of the tokens `batch` keeps (the forward's positions and
        its mask's query rows); None: every token, in order."""
        return None

    def loss(self, loss: torch.Tensor) -> torch.Tensor:
        """A microbatch's loss as its backward runs on it."""
        return loss


@dataclass(frozen=True)
class ApplyArgs:
    """What an apply function is given: the model on the meta device and everything about the run."""

    model: nn.Module
    units: Units
    tp_styles: Any
    """The family's `tensor_parallel.TensorParallelStylesFn`, or None (the family has none)."""
    dims: ParallelDims
    cfg: JobConfig
    replay: HostReplay
    """Host values the blocks' forwards read, replayed by full activation checkpointing's recompute."""
    high_precision: tuple[str, ...] = ()
    """The family's linear layers that stay in high precision (`ShapeRules.high_precision`)."""
    reshard: Any = None
    """The data phase's: the model's `reshard.ReshardPolicy`, read by the compiled graphs too."""
    own: dict[nn.Module, Any] = field(default_factory=dict)
    """The data phase's: the modules the model phase placed on a mesh of their own, with that mesh."""


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
    all_to_all: Callable[[float], float] = lambda nbytes: 0.0
    """Seconds of an all-to-all in which each rank of this unit's group holds that many bytes to exchange."""


Rules = Callable[[JobConfig, ParallelDims, Any, Any], None]
"""`(cfg, dims, spec, args)`: the config, the mesh degrees, the family's `ModelSpec` and its model args."""


def _no_hook(dims: ParallelDims) -> StepHook | None:
    return None


@dataclass(frozen=True)
class Stages:
    """A parallelism that cuts the model into stages over its ranks (module docstring: stages)."""

    plan: Callable[[JobConfig, ParallelDims, Any], Any]
    """`(cfg, dims, args)`: the stage layout (`RunPlan.pipeline`): which blocks each stage holds, which stages
    a rank runs (`stages_of`), the microbatches."""
    keep: Callable[[nn.Module, Units, Any, int], None]
    """`(model, units, plan, stage)`: reduce the model on the meta device to one stage."""
    runner: Callable[..., Any]
    """`(plan, parts, dims, device, context, backwards_per_step)`: the step runner over the rank's stages."""
    union: Callable[[list[nn.Module]], nn.Module]
    """`(parts)`: a rank's stages as the one module the rest of the run sees (its runner's `model`, the dry
    run's): the stage itself, or their union under the model's own parameter names."""


@dataclass(frozen=True)
class StepPolicies:
    """A parallelism that holds state across a step's backwards (module docstring: step_policies)."""

    candidates: Callable[[JobConfig, ParallelDims, int], tuple[list[StepPolicy], list[str]]]
    """`(cfg, dims, backwards)`: the policies the config allows for a step of that many backwards, most
    collectives saved first, and why a choice is fixed, in words (`RunPlan.step_candidates`)."""
    apply: Callable[[nn.Module, StepPolicy], None]
    """`(model, policy)`: what the chosen policy changes in the parallelized model on the meta device,
    before it is materialised (kept gathers: no reshard-after-forward)."""


@dataclass(frozen=True)
class ParallelismUnit:
    """One parallelism (module docstring)."""

    name: str
    on: Callable[[JobConfig, ParallelDims], bool]
    """Whether the run has it: its degree in the mesh above one, or its switch in the config."""
    rules: Rules
    apply: Callable[[ApplyArgs], dict[nn.Module, Any]]
    """Returns the modules it placed on a mesh of their own (a `DataParallelMesh` each), else nothing."""
    phase: Literal["model", "data"] = "model"
    """`model`: applied before activation checkpointing and compilation; `data`: after them, given the
    reshard policy and the modules with their own mesh (`parallelize.py`)."""
    gathers: Callable[[ApplyArgs], None] | None = None
    """After the data phase: what it changes in the weights' gathers (float8 bits on the wire)."""
    step_hook: Callable[[ParallelDims], StepHook | None] = _no_hook
    stages: Stages | None = None
    step_policies: StepPolicies | None = None
    step_time: Callable[[StageWork], float] | None = None
    group: Callable[[ParallelDims], tuple[int, int]] | None = None
    """(ranks, stride in ranks) of its group in the mesh, innermost dims fastest; with `step_time`."""
    comm_words: str = ""
    """What its `step_time` term counts, in the layout search's words (`exposed tp collectives`); with
    `step_time`."""
    compile_options: Callable[[JobConfig], dict[str, Any]] | None = None
    """Inductor settings its layers need where compiled, patched into the run's own compiles only
    (`parallelize.compile_options`, read by the compiler)."""
    graph_break: Callable[[nn.Module], bool] | None = None
    """Whether a block runs this parallelism eagerly inside its forward, which the compiled block then
    compiles around (`parallelize.graph_break`)."""
    check_device: Callable[[JobConfig, torch.device], None] | None = None
    """`(cfg, device)`: refuses, in one-line `ConfigError`s, a device the ranks cannot run it on; apart from
    `rules` since a plan is also made on a machine without that device (the dry run), and called by the
    launcher's preflight with the ranks' device (`parallelize.check_device`)."""
    sharded_view: Callable[[nn.Module | list[nn.Module]], AbstractContextManager[None]] | None = None
    """`(model or parts)`: a context in which attribute access on the weights it re-parametrizes returns them
    as stored (the shards) instead of computing them, so a state dict reads them without a collective; a
    model without its parametrization is left as it is (`parallelize.sharded_view`, read by checkpoints)."""


def when_on(on: Callable[[JobConfig, ParallelDims], bool], rules: Rules) -> Rules:
    """`rules` checked only where the unit is `on` (a unit with no keys of its own to refuse when off)."""

    def checked(cfg: JobConfig, dims: ParallelDims, spec: Any, args: Any) -> None:
        if on(cfg, dims):
            rules(cfg, dims, spec, args)

    return checked
