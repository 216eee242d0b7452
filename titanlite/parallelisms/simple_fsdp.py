"""SimpleFSDP: data parallelism as a parametrization of DTensor parameters.

Each parameter is stored as a DTensor sharded (or replicated) over the data-parallel mesh dims. A
property-based parametrization replaces `module.weight` with `replicate_compute(sharded)`, which
redistributes the DTensor to Replicate (an all-gather) and returns the local tensor with `Partial("avg")`
gradient placements. Autograd then emits the matching collective in backward:

    fully_shard   Shard(0)            -> all-gather fwd, reduce-scatter bwd        (FSDP)
    replicate     Replicate()         -> nothing fwd, all-reduce bwd               (DDP)
    hybrid_shard  Replicate, Shard(0) -> all-gather fwd, reduce-scatter+all-reduce (HSDP)

Because the module's `_parameters` keep the sharded DTensors, `state_dict()`, the optimizer and DCP only
ever see shards: nothing is gathered on save. Under tensor parallelism the parameter lives on the joint
(dp..., tp) mesh; the gather runs over the dp dims only and hands back a DTensor on the tp mesh.

Mixed precision casts to `param_dtype` before the all-gather and reduces gradients in `reduce_dtype`.

Gradient accumulation: by default every backward reduces. While `routing_to_sinks()` is active the
gathered weights' gradients accumulate unreduced in a per-parameter leaf (the sink) instead; the
once-per-step reduction of those sinks is `step_reduction.unreduced`.

Reshard-after-forward (eager): gathered weights that autograd would save for backward are replaced by a
recipe to gather them again (saved-tensor hooks), so only shards stay resident between forward and
backward. Under torch.compile the same effect comes from tagging the gathers must-recompute in the graph.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from titanlite.parallelisms.reshard import ReshardPlan
from titanlite.parallelisms.units import Units


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


class ReplicateComputation(nn.Module):
    """Gathers one sharded DTensor parameter to a full (per-tp-shard) tensor for compute."""

    def __init__(
        self,
        dp_mesh: DeviceMesh,
        mode: str,
        mp_policy: MixedPrecisionPolicy,
        tp_mesh: DeviceMesh | None = None,
        tp_placements: tuple[Placement, ...] = (),
        tp_local_shape: torch.Size | None = None,
        global_shape: torch.Size | None = None,
        global_stride: tuple[int, ...] | None = None,
    ):
        super().__init__()
        self.dp_mesh, self.mode, self.mp = dp_mesh, mode, mp_policy
        self.tp_mesh, self.tp_placements = tp_mesh, tp_placements
        self.tp_local_shape, self.global_shape, self.global_stride = tp_local_shape, global_shape, global_stride
        self.dp_placements = dp_placements(mode)
        self.replicated = tuple(Replicate() for _ in self.dp_placements)
        self.grad_placements = tuple(Partial("avg") for _ in self.dp_placements)
        self.reshard_after_forward = False
        self.sink: torch.Tensor | None = None
        """Gradient accumulation leaf of `unreduced()` mode (zero strides: one element of storage)."""
        self.step_cache: Any = None
        """Set inside `kept_gathers.kept_gathers`: makes this gather once per step and hands it out."""
        self.on_sink_grad: Callable[[ReplicateComputation], None] | None = None
        """Called after each backward's accumulation into the sink (the step's reduction starts buckets)."""

    def _gather_local(self, x: DTensor) -> torch.Tensor:
        """The dp all-gather of `x` as a plain tensor (under TP: this tp rank's full shard)."""
        if self.tp_mesh is None:
            dp_x = x
        else:
            # Gather over the dp dims only: view this rank's shard as a dp-mesh DTensor of the tp-local tensor.
            dp_x = DTensor.from_local(
                x.to_local(),
                self.dp_mesh,
                self.dp_placements,
                run_check=False,
                shape=self.tp_local_shape,
                stride=_contiguous_stride(self.tp_local_shape),
            )
        return dp_x.redistribute(
            placements=self.replicated, forward_dtype=self.mp.param_dtype, backward_dtype=self.mp.reduce_dtype
        ).to_local(grad_placements=self.grad_placements)

    def _as_tp(self, full: torch.Tensor) -> torch.Tensor:
        if self.tp_mesh is None:
            return full
        return DTensor.from_local(
            full, self.tp_mesh, self.tp_placements, run_check=False, shape=self.global_shape, stride=self.global_stride
        )

    def replicate_compute(self, x: DTensor) -> torch.Tensor:
        return self._as_tp(self._gather_local(x))

    def gather_unreduced(self, x: DTensor) -> torch.Tensor:
        """The same gather, whose gradient accumulates in `self.sink` instead of being reduced."""
        assert self.sink is not None, "unreduced() sets up the sinks before the forward"
        with torch.no_grad():
            full = self._gather_local(x)
        return self._as_tp(_RouteGradient.apply(full, self.sink))

    def make_sink(self, x: DTensor) -> None:
        """A leaf of the gathered (tp-local) shape: the unsharded gradient accumulates in its `.grad`, in
        fp32 (or the parameter's dtype if wider) whatever the reduce dtype, so the microbatches' sum is
        not rounded to the wire's bf16. Its zero strides keep the leaf itself at one element. After each
        accumulation it calls `on_sink_grad`."""
        shape = x.shape if self.tp_mesh is None else self.tp_local_shape
        dtype = torch.promote_types(x.dtype, torch.float32)
        sink = torch.empty_strided(shape, (0,) * len(shape), dtype=dtype, device=x.to_local().device)
        self.sink = sink.zero_().requires_grad_()
        self.sink.register_post_accumulate_grad_hook(self._sink_accumulated)

    def _sink_accumulated(self, sink: torch.Tensor) -> None:
        if self.on_sink_grad is not None:
            self.on_sink_grad(self)

    def forward(self, x: DTensor) -> torch.Tensor:
        if self.step_cache is not None:
            return self.step_cache(self, x)
        if _UNREDUCED and x.requires_grad and torch.is_grad_enabled():
            out = self.gather_unreduced(x)
        else:
            out = self.replicate_compute(x)
        if self.reshard_after_forward and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            root = out._base if out._is_view() else out
            _GATHERED[id(root)] = root
            _RECIPES[id(root)] = (self, x, out.shape, out.stride())
        return out


class _RouteGradient(torch.autograd.Function):
    """Identity on a gathered weight whose gradient goes to `sink` (autograd casts it to the sink's dtype
    and accumulates it there across backwards) rather than back through the gather's reduction."""

    @staticmethod
    def forward(ctx: Any, full: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
        return full.view_as(full)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, grad


def dp_placements(mode: str) -> tuple[Placement, ...]:
    return {"fully_shard": (Shard(0),), "replicate": (Replicate(),), "hybrid_shard": (Replicate(), Shard(0))}[mode]


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


# --- property-based parametrization ------------------------------------------------------------------


_SHARDED_VIEW = False


@contextlib.contextmanager
def sharded_view():
    """Attribute access returns the sharded DTensor parameters instead of gathering them.

    For code that walks modules by attribute (torch's `get_state_dict`/`set_state_dict` resolve FQNs
    with `getattr`): without this every parameter would be all-gathered just to be named.
    """
    global _SHARDED_VIEW
    previous, _SHARDED_VIEW = _SHARDED_VIEW, True
    try:
        yield
    finally:
        _SHARDED_VIEW = previous


_UNREDUCED = False


def parametrized(model: nn.Module) -> list[tuple[ReplicateComputation, DTensor]]:
    """Every (gather, its sharded parameter) under `model` that takes gradients, in forward order."""
    out = []
    for module in model.modules():
        gathers = module._modules.get("_simple_fsdp")
        for name, gather in gathers.items() if gathers is not None else ():
            param = module._parameters[name]
            if param is not None and param.requires_grad:
                out.append((gather, param))
    return out


def is_unreduced() -> bool:
    """Whether gathers now route gradients to their sinks (inside `unreduced`): graphs traced now hold
    no gradient reductions."""
    return _UNREDUCED


@contextlib.contextmanager
def routing_to_sinks() -> Iterator[None]:
    """Gathers inside route their gradients to the sinks (`make_sink` first) instead of reducing them."""
    global _UNREDUCED
    previous, _UNREDUCED = _UNREDUCED, True
    try:
        yield
    finally:
        _UNREDUCED = previous


def _register_parametrization(module: nn.Module, parametrizations: dict[str, ReplicateComputation]) -> None:
    """Make `module.<name>` return `parametrization(module._parameters[name])`.

    A subclass of the module's class (shared by every module of that class with the same parameter
    names) has one property per parameter, so attribute access goes through the gather while
    `_parameters`, `named_parameters()` and `state_dict()` keep the shards. The parameters must already
    be registered before the class swap (`register_parameter` refuses a name that is already a property).
    """
    module._simple_fsdp = nn.ModuleDict(parametrizations)  # type: ignore[assignment]

    def make_getter(name: str):
        def getter(self: nn.Module) -> torch.Tensor:
            if _SHARDED_VIEW:
                return self._parameters[name]
            return self._simple_fsdp[name](self._parameters[name])

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


# (class, parameter names) -> its parametrized subclass. One class for all modules of the same class and
# parameters, so identical transformer blocks have the same type: Dynamo's type guards then match every
# block and one trace serves them all (a class per instance would cost one Dynamo + AOT trace per block).
_SUBCLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def _leading_submesh(mesh: DeviceMesh, ndim: int) -> DeviceMesh:
    """The submesh of `mesh`'s first `ndim` dims (the data-parallel ones)."""
    names = mesh.mesh_dim_names
    return mesh[names[:ndim]] if ndim > 1 else mesh[names[0]]


def _shard_parameter(
    param: nn.Parameter, mesh: DeviceMesh, mode: str, dp_ndim: int
) -> tuple[nn.Parameter, dict[str, Any]]:
    """Place `param` (a plain tensor, or a TP DTensor) on the data-parallel dims of `mesh`."""
    placements = dp_placements(mode)
    if not isinstance(param, DTensor):
        dt = distribute_tensor(param.data, mesh, placements, src_data_rank=None)
        return nn.Parameter(dt, requires_grad=param.requires_grad), {}
    tp_placements = tuple(param.placements)
    tp_local = param.detach().to_local()
    dp_mesh = _leading_submesh(mesh, dp_ndim)
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


def data_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    mode: str,
    mp_policy: MixedPrecisionPolicy | None = None,
    dp_ndim: int | None = None,
) -> nn.Module:
    """Apply SimpleFSDP to every parameter of `model`, in place.

    `mesh` is the data-parallel mesh (1D, or 2D for hybrid_shard), or the joint (dp..., tp) mesh when the
    model is already tensor-parallel; `dp_ndim` says how many leading dims of `mesh` are data-parallel.
    """
    mp_policy = mp_policy or MixedPrecisionPolicy()
    dp_ndim = dp_ndim or mesh.ndim
    dp_mesh = mesh if mesh.ndim == dp_ndim else _leading_submesh(mesh, dp_ndim)
    for module in list(model.modules()):
        names = [n for n, p in module.named_parameters(recurse=False) if p is not None]
        if not names:
            continue
        parametrizations = {}
        for name in names:
            param, extra = _shard_parameter(module._parameters[name], mesh, mode, dp_ndim)
            module.register_parameter(name, param)
            parametrizations[name] = ReplicateComputation(dp_mesh, mode, mp_policy, **extra)
        _register_parametrization(module, parametrizations)
    return model


def set_reshard_after_forward(module: nn.Module, enabled: bool) -> None:
    """Turn reshard-after-forward on or off for every SimpleFSDP parameter under `module`."""
    for sub in module.modules():
        if isinstance(sub, ReplicateComputation):
            sub.reshard_after_forward = enabled


def apply_reshard(model: nn.Module, units: Units, plan: ReshardPlan) -> None:
    """Eager reshard-after-forward for the units `plan` frees (compiled units use the graph tags instead)."""
    if not plan.any:
        return
    for block, freed in zip(units.blocks.values(), plan.blocks):
        set_reshard_after_forward(block, freed)
    if plan.root:
        for name in units.roots:
            set_reshard_after_forward(model.get_submodule(name), True)
    ReshardAfterForward(model)


# --- eager reshard-after-forward via saved-tensor hooks -----------------------------------------------

# Gathered outputs of this forward, by id, and how to gather each again. Weak values: an entry lives only
# as long as the gathered tensor itself.
_GATHERED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_RECIPES: dict[int, tuple[ReplicateComputation, DTensor, torch.Size, tuple[int, ...]]] = {}


class _Regather:
    """Stands in for a saved gathered weight (or its transpose) until backward needs it."""

    __slots__ = ("gather", "sharded", "transposed")

    def __init__(self, gather: ReplicateComputation, sharded: DTensor, transposed: bool):
        self.gather, self.sharded, self.transposed = gather, sharded, transposed

    def materialize(self) -> torch.Tensor:
        with torch.no_grad():
            full = self.gather.replicate_compute(self.sharded)
        return full.t() if self.transposed else full


def _pack(t: torch.Tensor) -> Any:
    """Replace a saved gathered weight (the tensor the gather returned, or its transpose) by a recipe."""
    root = t._base if t._is_view() else t
    key = id(root)
    if _GATHERED.get(key) is not root:
        return t
    gather, sharded, shape, stride = _RECIPES[key]
    if t.shape == shape and t.stride() == stride:
        return _Regather(gather, sharded, transposed=False)
    if t.dim() == 2 and t.shape == shape[::-1] and t.stride() == stride[::-1]:
        return _Regather(gather, sharded, transposed=True)
    return t  # an unexpected view: keep it (correct, just not resharded)


def _unpack(obj: Any) -> torch.Tensor:
    return obj.materialize() if isinstance(obj, _Regather) else obj


class ReshardAfterForward:
    """Forward hooks on the root module that drop gathered weights from autograd's saved tensors."""

    def __init__(self, root: nn.Module):
        self._ctx: torch.autograd.graph.saved_tensors_hooks | None = None
        root.register_forward_pre_hook(self._enter)
        root.register_forward_hook(self._exit, always_call=True)

    def _enter(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            self._ctx = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
            self._ctx.__enter__()

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None
        _RECIPES.clear()
        _GATHERED.clear()
