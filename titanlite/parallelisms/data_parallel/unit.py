"""Data parallelism as a unit: SimpleFSDP, FSDP2 or pure replication over the data-parallel dims.

The last phase of the order (`parallelize.py`), after activation checkpointing and compilation: SimpleFSDP
(`simple_fsdp.data_parallel`, its eager reshard-after-forward `eager_reshard.apply_reshard`) or FSDP2
(`fsdp2.apply_fsdp2`, `parallelism.dp_impl`), with the configured mixed precision and the model's one
reshard policy (`reshard.ReshardPolicy`, which the compiled graphs' recompute tags read too). The modules the
model phase placed on a mesh of their own (expert parallelism's experts) are sharded there.

Its rules are the mesh's (`ParallelDims`). Its step policies (`StepPolicies`) are the gradient reduction's
and the kept gathers': which a run allows (`gradient_reduction.step_candidates`), and the model built for
kept gathers (`kept_gathers.keep_for_step`); the step runs them in the step context
(`step_context.StepContext.reduction`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from torch import nn

from titanlite import torch_support
from titanlite.config import JobConfig
from titanlite.parallelisms.data_parallel.gradient_reduction import step_candidates
from titanlite.parallelisms.parallel_dims import ParallelDims
from titanlite.parallelisms.parallelism import ApplyArgs, ParallelismUnit, StepPolicies
from titanlite.parallelisms.step_policy import StepPolicy


def _rules(cfg: JobConfig, dims: ParallelDims, spec: Any, args: Any) -> None:
    """None beyond the mesh's own (`ParallelDims.from_config`)."""


def _apply(a: ApplyArgs) -> dict[nn.Module, Any]:
    """SimpleFSDP or FSDP2 with the configured mixed precision and the reshard policy (`a.reshard`); `a.own`:
    the modules on a mesh of their own."""
    # Imported here, where ranks build their model: the run plan imports the order in the launcher, before
    # any rank, which imports neither DTensor nor FSDP2.
    from titanlite.parallelisms.data_parallel.eager_reshard import apply_reshard
    from titanlite.parallelisms.data_parallel.fsdp2 import apply_fsdp2
    from titanlite.parallelisms.data_parallel.simple_fsdp import MixedPrecisionPolicy, data_parallel

    cfg, dims = a.cfg, a.dims
    param_dtype = torch_support.dtype(cfg.training.mixed_precision_param)
    reduce_dtype = torch_support.dtype(cfg.training.mixed_precision_reduce)
    if cfg.parallelism.dp_impl == "fsdp2":
        apply_fsdp2(a.model, a.units, dims.fsdp_mesh, param_dtype, reduce_dtype, a.reshard)
        return {}
    data_parallel(
        a.model,
        dims.param_mesh,
        dims.dp_mode,
        MixedPrecisionPolicy(param_dtype, reduce_dtype),
        dp_ndim=dims.param_ndim,
        own_meshes=a.own,
    )
    apply_reshard(a.model, a.units, a.reshard)
    return {}


def _sharded_view(model: nn.Module | list[nn.Module]) -> AbstractContextManager[None]:
    """SimpleFSDP's parameters seen as their shards (`simple_fsdp.sharded_view`); FSDP2's and replication's
    attribute access reads them as stored already."""
    from titanlite.parallelisms.data_parallel.simple_fsdp import sharded_view  # DTensor: ranks and tools only

    return sharded_view(model)


def _candidates(cfg: JobConfig, dims: ParallelDims, backwards: int) -> tuple[list[StepPolicy], list[str]]:
    """`gradient_reduction.step_candidates` under the mesh's data-parallel mode."""
    return step_candidates(cfg, dims.dp_mode, backwards)


def _apply_policy(model: nn.Module, policy: StepPolicy) -> None:
    """Kept gathers: the built model reshards nothing after forward (`kept_gathers.keep_for_step`)."""
    if policy.keep_gathers:
        from titanlite.parallelisms.data_parallel.kept_gathers import keep_for_step  # DTensor: ranks only

        keep_for_step(model)


UNIT = ParallelismUnit(
    name="data",
    on=lambda cfg, dims: dims.dp_enabled,
    rules=_rules,
    apply=_apply,
    phase="data",
    step_policies=StepPolicies(_candidates, _apply_policy),
    sharded_view=_sharded_view,
)
"""Data parallelism as one unit (`parallelism.ParallelismUnit`); its collectives' time is the step-time
model's own term (`planning/data_parallel_time.py`)."""
