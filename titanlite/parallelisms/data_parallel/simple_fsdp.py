"""SimpleFSDP: data parallelism as a parametrization of DTensor parameters.

Each parameter is stored as a DTensor sharded (or replicated) over the data-parallel mesh dims, and a
parametrization replaces `module.weight` with `replicate_compute(sharded)`: a redistribution to Replicate
with `Partial("avg")` gradients, so autograd emits the matching collective in backward (FSDP: all-gather and
reduce-scatter; DDP: all-reduce; HSDP: both). The module's `_parameters` keep the shards, so `state_dict()`,
the optimizer and DCP never gather. This file shards the parameters and installs the parametrization
(`data_parallel`) and reaches a wrapped model's state (`simple_fsdp_states`, `gathers_of`); the gather itself
is `replicate_compute.py`, eager reshard-after-forward `eager_reshard.py`, the once-per-step reduction
`step_reduction.py`, the step's kept gathers `kept_gathers.py`. Every wrapped model owns its `SimpleFSDPState`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from titanlite.parallelisms.data_parallel.replicate_compute import (
    MixedPrecisionPolicy,
    ReplicateComputation,
    SimpleFSDPState,
    dp_placements,
)

__all__ = [
    "DataParallelMesh",
    "MixedPrecisionPolicy",
    "data_parallel",
    "gathers_of",
    "parametrized",
    "sharded_view",
    "simple_fsdp_states",
]

_GATHERS = "_simple_fsdp"
"""The submodule (a ModuleDict, parameter name -> its gather) a parametrized module holds; read through
`gathers_of` only."""
_STATE = "_simple_fsdp_state"
"""The attribute of a wrapped root holding its `SimpleFSDPState`; read through `simple_fsdp_states` only."""


def simple_fsdp_states(model: nn.Module | Iterable[nn.Module]) -> list[SimpleFSDPState]:
    """The state of every model `data_parallel` wrapped within `model` (the root itself, a submodule of
    it, or each of a list of pipeline parts), each once, in module order."""
    roots = [model] if isinstance(model, nn.Module) else list(model)
    out: dict[int, SimpleFSDPState] = {}
    for root in roots:
        for module in root.modules():
            state = module.__dict__.get(_STATE)
            if state is not None:
                out.setdefault(id(state), state)
    return list(out.values())


def gathers_of(module: nn.Module) -> Mapping[str, ReplicateComputation]:
    """Parameter name -> its gather, for the parameters `data_parallel` parametrized directly on `module`
    (empty for any other module)."""
    gathers = module._modules.get(_GATHERS)
    return gathers if gathers is not None else {}  # type: ignore[return-value]


def parametrized(model: nn.Module) -> list[tuple[ReplicateComputation, DTensor]]:
    """Every (gather, its sharded parameter) under `model` that takes gradients, in forward order."""
    out, seen = [], set()
    for module in model.modules():
        for name, gather in gathers_of(module).items():
            param = module._parameters[name]
            if param is not None and param.requires_grad and id(gather) not in seen:  # a shared one once
                seen.add(id(gather))
                out.append((gather, param))
    return out


@contextlib.contextmanager
def sharded_view(model: nn.Module | Iterable[nn.Module]) -> Iterator[None]:
    """Attribute access on `model` (a wrapped model or a list of parts) returns the sharded DTensor
    parameters instead of gathering them (`SimpleFSDPState.viewing_shards`); a model without SimpleFSDP
    is left as it is."""
    with contextlib.ExitStack() as stack:
        for state in simple_fsdp_states(model):
            stack.enter_context(state.viewing_shards())
        yield


def _register_parametrization(module: nn.Module, parametrizations: dict[str, ReplicateComputation]) -> None:
    """Make `module.<name>` return `parametrization(module._parameters[name])`.

    A subclass of the module's class (shared by every module of that class with the same parameter
    names) has one property per parameter, so attribute access goes through the gather while
    `_parameters`, `named_parameters()` and `state_dict()` keep the shards. The parameters must already
    be registered before the class swap (`register_parameter` refuses a name that is already a property).
    """
    setattr(module, _GATHERS, nn.ModuleDict(parametrizations))

    def make_getter(name: str):
        def getter(self: nn.Module) -> torch.Tensor:
            gather = getattr(self, _GATHERS)[name]
            if gather.state.sharded_view:
                return self._parameters[name]
            return gather(self._parameters[name])

        return getter

    def make_setter(name: str):
        def setter(self: nn.Module, value: Any) -> None:
            self._parameters[name] = value

        return setter

    key = (module.__class__, tuple(parametrizations))
    if key not in _SUBCLASSES:
        props = {name: property(make_getter(name), make_setter(name)) for name in parametrizations}
        _SUBCLASSES[key] = type(f"SimpleFSDP{key[0].__name__}", (key[0],), props)
    module.__class__ = _SUBCLASSES[key]


_SUBCLASSES: dict[tuple[type, tuple[str, ...]], type] = {}
"""(class, parameter names) -> its parametrized subclass: a memo of a pure function, shared by the process.

A subclass depends on its key alone: its properties read the gather and the state from the instance
(`self._simple_fsdp[name].state`), never from the model that first made it, so an entry is never changed
and holds no model's state; a model wrapped later gets the same class as one wrapped before. One class
for all modules of the same class and parameters, so identical transformer blocks have the same type:
Dynamo's type guards then match every block and one trace serves them all (a class per instance, or per
model, would cost one Dynamo + AOT trace per block, or per model)."""


def _leading_submesh(mesh: DeviceMesh, ndim: int) -> DeviceMesh:
    """The submesh of `mesh`'s first `ndim` dims (the data-parallel ones); `mesh` itself when that is all."""
    names = mesh.mesh_dim_names
    if ndim == mesh.ndim:
        return mesh
    return mesh[names[:ndim]] if ndim > 1 else mesh[names[0]]


def _shard_parameter(
    param: nn.Parameter, mesh: DeviceMesh, mode: str, dp_mesh: DeviceMesh
) -> tuple[nn.Parameter, dict[str, Any]]:
    """Place `param` (a plain tensor, or a TP DTensor) on the data-parallel dims of `mesh` (`dp_mesh`)."""
    placements = dp_placements(mode)
    if not isinstance(param, DTensor):
        dt = distribute_tensor(param.data, mesh, placements, src_data_rank=None)
        return nn.Parameter(dt, requires_grad=param.requires_grad), {}
    tp_placements = tuple(param.placements)
    tp_local = param.detach().to_local()
    dp_local = distribute_tensor(tp_local, dp_mesh, placements, src_data_rank=None).to_local()
    # When tp also shards dim 0, the dp shards are taken within each tp shard: a strided layout.
    tp_size = param.device_mesh.size()
    joint_dp = tuple(
        _StridedShard(0, split_factor=tp_size) if isinstance(p, Shard) and tp_placements[0] == Shard(0) else p
        for p in placements
    )
    dt = DTensor.from_local(
        dp_local, mesh, joint_dp + tp_placements, run_check=False, shape=param.shape, stride=param.stride()
    )
    extra = dict(
        tp_mesh=param.device_mesh,
        tp_placements=tp_placements,
        tp_local_shape=tp_local.shape,
        global_shape=param.shape,
        global_stride=param.stride(),
    )
    return nn.Parameter(dt, requires_grad=param.requires_grad), extra


@dataclass(frozen=True)
class DataParallelMesh:
    """Where a group of parameters is data-parallel: `mesh` (its first `dp_ndim` dims data-parallel, the
    rest a model-parallel dim the parameters are already DTensors on) and the SimpleFSDP `mode`."""

    mesh: DeviceMesh
    mode: str
    dp_ndim: int

    @functools.cached_property
    def dp_mesh(self) -> DeviceMesh:
        """The data-parallel dims of `mesh`, sliced once: slicing a DeviceMesh builds a new one each time
        (milliseconds; a 70B model has over 700 parameters)."""
        return _leading_submesh(self.mesh, self.dp_ndim)


def data_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    mode: str,
    mp_policy: MixedPrecisionPolicy | None = None,
    dp_ndim: int | None = None,
    own_meshes: Mapping[nn.Module, DataParallelMesh] | None = None,
) -> nn.Module:
    """Apply SimpleFSDP to every parameter of `model`, in place.

    `mesh` is the data-parallel mesh (1D, or 2D for hybrid_shard), or the joint (dp..., tp) mesh when the
    model is already tensor-parallel; `dp_ndim` says how many leading dims of `mesh` are data-parallel.
    `own_meshes`: modules whose direct parameters are data-parallel elsewhere (expert-parallel experts,
    on their ([dp_replicate,] efsdp, ep) mesh). `model` keeps the `SimpleFSDPState` its gathers share
    (`simple_fsdp_states(model)`), whatever their mesh.
    """
    state = SimpleFSDPState()
    mp_policy = mp_policy or MixedPrecisionPolicy()
    default = DataParallelMesh(mesh, mode, dp_ndim or mesh.ndim)
    # A Parameter several modules share (tied embeddings, `tied_parameters.py`) is sharded once and has
    # one gather, which every module holding it reads (one gradient sink, one reduction).
    done: dict[int, tuple[nn.Parameter, ReplicateComputation]] = {}
    for module in list(model.modules()):
        names = [n for n, p in module._parameters.items() if p is not None]
        if not names:
            continue
        where = (own_meshes or {}).get(module, default)
        parametrizations = {}
        for name in names:
            original = module._parameters[name]
            if id(original) not in done:
                param, extra = _shard_parameter(original, where.mesh, where.mode, where.dp_mesh)
                done[id(original)] = param, ReplicateComputation(state, where.dp_mesh, where.mode, mp_policy, **extra)
            param, parametrizations[name] = done[id(original)]
            module.register_parameter(name, param)
        _register_parametrization(module, parametrizations)
    model.__dict__[_STATE] = state
    return model
