"""The order of the parallelisms, owned by the framework and written once.

Every parallelism is a unit (`parallelism.ParallelismUnit`) in `PARALLELISMS`; the run plan, the build, the
step context (`step_hooks`) and the step-time model read that tuple too, so a new parallelism is its folder,
its setting and its place there. The model phase runs in the tuple's order (float8, tensor, context and
expert parallelism; pipeline stages are cut earlier by the build), then activation checkpointing, the
caller's compile phase, data parallelism (SimpleFSDP or FSDP2), each unit's `gathers` and the eager
prefetch. Each step needs what the one before placed: TP's and EP's DTensors are sharded further by data
parallelism, AC's `CheckpointedBlock`s are what compile reads, tied parameters are retied before data
parallelism shards them once, and lazy compilation traces SimpleFSDP's gathers into its graphs. Why each
step sits where it does: docs/parallelism.md. A family supplies data only; the model is on the meta device.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from titanlite.config import JobConfig
from titanlite.parallelisms.activation_checkpoint import CheckpointedBlock, apply_ac
from titanlite.parallelisms.context_parallel import unit as context_parallel
from titanlite.parallelisms.data_parallel import unit as data_parallel
from titanlite.parallelisms.data_parallel.reshard import ReshardPolicy
from titanlite.parallelisms.expert_parallel import unit as expert_parallel
from titanlite.parallelisms.float8 import unit as float8
from titanlite.parallelisms.host_replay import HostReplay
from titanlite.parallelisms.parallel_dims import ParallelDims
from titanlite.parallelisms.parallelism import ApplyArgs, ParallelismUnit, Stages, StepHook, StepPolicies
from titanlite.parallelisms.pipeline import unit as pipeline
from titanlite.parallelisms.step_policy import StepPolicy
from titanlite.parallelisms.tensor_parallel import unit as tensor_parallel
from titanlite.parallelisms.tied_parameters import TiedParameters
from titanlite.parallelisms.units import Units

if TYPE_CHECKING:
    from titanlite.parallelisms.tensor_parallel.unit import TensorParallelStylesFn

PARALLELISMS: tuple[ParallelismUnit, ...] = (
    float8.UNIT,
    tensor_parallel.UNIT,
    context_parallel.UNIT,
    expert_parallel.UNIT,
    pipeline.UNIT,
    data_parallel.UNIT,
)
"""The parallelism units in the order they are applied (module docstring)."""


def _order(order: tuple[ParallelismUnit, ...] | None) -> tuple[ParallelismUnit, ...]:
    return PARALLELISMS if order is None else order


def check_rules(cfg: JobConfig, dims: ParallelDims, spec: object, args: object) -> None:
    """Every unit's rules, on or off, in the order (`ParallelismUnit.rules`)."""
    for unit in _order(None):
        unit.rules(cfg, dims, spec, args)


def enabled(
    cfg: JobConfig, dims: ParallelDims, order: tuple[ParallelismUnit, ...] | None = None
) -> list[ParallelismUnit]:
    """The units of `order` (default `PARALLELISMS`, read when called) this run has (`ParallelismUnit.on`)."""
    return [unit for unit in _order(order) if unit.on(cfg, dims)]


def step_hooks(cfg: JobConfig, dims: ParallelDims) -> tuple[StepHook, ...]:
    """The step hooks of the units this run has, in order (`step_context.StepContext.hooks`)."""
    return tuple(hook for unit in enabled(cfg, dims) if (hook := unit.step_hook(dims)) is not None)


def staging(cfg: JobConfig, dims: ParallelDims) -> Stages | None:
    """The stages of the unit that cuts the model over ranks (`ParallelismUnit.stages`), or None."""
    return next((unit.stages for unit in enabled(cfg, dims) if unit.stages is not None), None)


def _step_policies(cfg: JobConfig, dims: ParallelDims) -> StepPolicies | None:
    return next((unit.step_policies for unit in enabled(cfg, dims) if unit.step_policies is not None), None)


def step_candidates(cfg: JobConfig, dims: ParallelDims, backwards: int) -> tuple[list[StepPolicy], list[str]]:
    """The step policies this run allows for a step of `backwards` backwards, most collectives saved first,
    and why a choice is fixed, in words: those of the unit that holds state across a step's backwards
    (`ParallelismUnit.step_policies`), else only `StepPolicy()` (nothing is held)."""
    policies = _step_policies(cfg, dims)
    return policies.candidates(cfg, dims, backwards) if policies is not None else ([StepPolicy()], [])


def apply_step_policy(model: nn.Module, policy: StepPolicy, cfg: JobConfig, dims: ParallelDims) -> None:
    """What the chosen step `policy` changes in `model`, parallelized on the meta device and not yet
    materialised (`StepPolicies.apply`)."""
    if (policies := _step_policies(cfg, dims)) is not None:
        policies.apply(model, policy)


def compile_options(cfg: JobConfig, dims: ParallelDims) -> dict[str, Any]:
    """The inductor settings the parallelisms of this run need where compiled (each unit's `compile_options`,
    in the order), which the compiler patches into its own compiles only."""
    options: dict[str, Any] = {}
    for unit in enabled(cfg, dims):
        if unit.compile_options is not None:
            options |= unit.compile_options(cfg)
    return options


def graph_break(block: nn.Module, cfg: JobConfig, dims: ParallelDims) -> bool:
    """Whether `block` runs a parallelism of this mesh eagerly inside its forward (a unit's `graph_break`),
    so its compiled forward is not one full graph."""
    return any(unit.graph_break(block) for unit in enabled(cfg, dims) if unit.graph_break is not None)


def check_device(cfg: JobConfig, dims: ParallelDims, device: torch.device) -> None:
    """Every rule of this run's units that needs the ranks' `device` (`ParallelismUnit.check_device`), in
    the order; raises the first one-line `ConfigError`."""
    for unit in enabled(cfg, dims):
        if unit.check_device is not None:
            unit.check_device(cfg, device)


@contextlib.contextmanager
def sharded_view(model: nn.Module | list[nn.Module]) -> Iterator[None]:
    """Attribute access on `model` (a module or a rank's pipeline parts) returns the weights as stored, not
    as any unit of the order re-parametrizes them (`ParallelismUnit.sharded_view`): a state dict then reads
    the shards without gathering them. Every unit, on or off: a model without its parametrization is left
    as it is, so a checkpoint needs no config to enter it."""
    with contextlib.ExitStack() as stack:
        for unit in _order(None):
            if unit.sharded_view is not None:
                stack.enter_context(unit.sharded_view(model))
        yield


class CompilePhase(Protocol):
    """Compilation's places in the order (module docstring), given by the caller (`run/build.py`), so that
    the parallelisms import no compiler: `apply` after activation checkpointing (`ac`: what `apply_ac`
    returned) and before data parallelism, `after_data_parallel` once the model is wrapped."""

    def apply(self, model: nn.Module, units: Units, ac: dict[str, CheckpointedBlock], reshard: ReshardPolicy) -> None:
        """Compile `model` in place (lazily: its graphs are traced at the first call)."""
        ...

    def after_data_parallel(self, model: nn.Module, units: Units, reshard: ReshardPolicy) -> None:
        """What compilation adds to the wrapped model (compile scope `prefetch`'s eager hooks)."""
        ...


def parallelize(
    model: nn.Module,
    units: Units,
    tp_styles: TensorParallelStylesFn | None,
    dims: ParallelDims,
    cfg: JobConfig,
    order: tuple[ParallelismUnit, ...] | None = None,
    high_precision: tuple[str, ...] = (),
    compiler: CompilePhase | None = None,
) -> nn.Module:
    """Apply every configured parallelism to `model` (on the meta device, its mesh built), in place, in
    the order above; returns `model`. `units` are the model's blocks and root modules, `tp_styles` the
    family's tensor-parallel styles (`ModelSpec.parallel.tp_styles`; None: the family has none, and TP must
    be off); `order` the units (default `PARALLELISMS`); `high_precision` the linear layers float8 never
    converts (`ShapeRules.high_precision`); `compiler` the compile phase (None: the model runs eager)."""
    # The host values the blocks' forwards read (expert parallelism's row splits), replayed by the
    # recompute of full activation checkpointing instead of read again.
    replay = HostReplay()
    tied = TiedParameters.of(model)
    on = enabled(cfg, dims, order)
    applied = ApplyArgs(model, units, tp_styles, dims, cfg, replay, high_precision)
    own: dict[nn.Module, object] = {}
    for unit in on:
        if unit.phase == "model":
            own |= unit.apply(applied)
    # Each unit replaced parameters module by module: a shared one is tied back before data parallelism,
    # which then shards it once (`tied_parameters.py`).
    tied.retie(model)
    ac = apply_ac(units.blocks, cfg.activation_checkpoint, replay)
    # One reshard policy for this model (or pipeline stage: its own blocks), read by the compiled graphs'
    # recompute tags and by the data-parallel wrapper alike.
    reshard = ReshardPolicy.of(
        cfg.parallelism.fsdp_reshard_after_forward, len(units.blocks), gathers=dims.dp_mode != "replicate"
    )
    if compiler is not None:
        compiler.apply(model, units, ac, reshard)
    placed = dataclasses.replace(applied, reshard=reshard, own=own)
    for unit in on:
        if unit.phase == "data":
            unit.apply(placed)
    for unit in on:
        if unit.gathers is not None:
            unit.gathers(placed)
    if compiler is not None:
        compiler.after_data_parallel(model, units, reshard)
    return model
