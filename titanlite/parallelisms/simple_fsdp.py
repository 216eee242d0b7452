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

Gradient accumulation: by default every backward reduces. Inside `unreduced(model)` the gathered
weights' gradients accumulate unreduced in a per-parameter leaf instead, and leaving the context reduces
each once: k microbatches cost one reduction per parameter instead of k.

Reshard-after-forward (eager): gathered weights that autograd would save for backward are replaced by a
recipe to gather them again (saved-tensor hooks), so only shards stay resident between forward and
backward. Under torch.compile the same effect comes from tagging the gathers must-recompute in the graph.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
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
        """A leaf of the gathered (tp-local) shape in the reduce dtype: the unsharded gradient accumulates
        in its `.grad`. Its zero strides keep the leaf itself at one element."""
        shape = x.shape if self.tp_mesh is None else self.tp_local_shape
        dtype = self.mp.reduce_dtype or x.dtype
        sink = torch.empty_strided(shape, (0,) * len(shape), dtype=dtype, device=x.to_local().device)
        self.sink = sink.zero_().requires_grad_()

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


def _parametrized(model: nn.Module) -> list[tuple[ReplicateComputation, DTensor]]:
    """Every (gather, its sharded parameter) under `model` that takes gradients."""
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
def unreduced(model: nn.Module):
    """Backwards inside accumulate each parameter's gradient unreduced and unsharded; leaving reduces each
    once into `param.grad`: one reduce-scatter (all-reduce for replicate) per bucket of gradients.

    For gradient accumulation: k backwards in this mode cost one reduction per parameter instead of k, at
    the price of holding the rank's gradients unsharded, in the reduce dtype, until the reduction. The
    forward's all-gathers are unchanged. Leaving on an exception drops what accumulated.
    """
    global _UNREDUCED
    pairs = _parametrized(model)
    for gather, param in pairs:
        if gather.sink is None:
            gather.make_sink(param)
    previous, _UNREDUCED = _UNREDUCED, True
    try:
        yield
    except BaseException:
        for gather, _ in pairs:
            gather.sink.grad = None  # type: ignore[union-attr]
        raise
    finally:
        _UNREDUCED = previous
    _reduce_sinks(pairs)


REDUCE_BUCKET_BYTES = 64 * 2**20
"""Unreduced gradients are reduced in buckets of about this many bytes: one collective per bucket."""


def _reduce_sinks(pairs: list[tuple[ReplicateComputation, DTensor]]) -> None:
    """Reduce every sink's gradient into its parameter's `.grad`, in buckets of the same dp mesh, mode and
    dtype; a bucket's unsharded gradients are freed as it is packed for its reduction."""
    groups: dict[tuple, list[list[tuple[DTensor, torch.Tensor]]]] = {}
    sizes: dict[tuple, int] = {}
    for gather, param in pairs:
        assert gather.sink is not None
        full, gather.sink.grad = gather.sink.grad, None
        if full is None:
            continue
        key = (gather.dp_mesh, gather.mode, full.dtype)
        group = groups.setdefault(key, [[]])
        if group[-1] and sizes[key] + full.nbytes > REDUCE_BUCKET_BYTES:
            group.append([])
            sizes[key] = 0
        group[-1].append((param, full))
        sizes[key] = sizes.get(key, 0) + full.nbytes
        del full  # the bucket holds the only reference
    for (mesh, mode, _), buckets in groups.items():
        while buckets:
            bucket = buckets.pop(0)
            params = [p for p, _ in bucket]
            for param, local in zip(params, _reduce_bucket(mesh, mode, bucket)):
                grad = DTensor.from_local(
                    local.to(param.dtype),
                    param.device_mesh,
                    param.placements,
                    run_check=False,
                    shape=param.shape,
                    stride=param.stride(),
                )
                param.grad = grad if param.grad is None else param.grad + grad


def _reduce_bucket(mesh: DeviceMesh, mode: str, bucket: list[tuple[DTensor, torch.Tensor]]) -> list[torch.Tensor]:
    """One reduction for a bucket of (parameter, full gradient); each parameter's averaged local shard.
    Empties `bucket`: each full gradient is freed once copied into the flat buffer, so packing needs about
    the bucket's size once more (a gradient larger than a bucket is its own bucket: twice its size).

    Each gradient is cut along dim 0 into one chunk per rank of the shard group, zero-padded to equal
    size; a flat (ranks, width) buffer holds the chunks side by side, so a reduce-scatter of its dim 0
    gives every rank its dim-0 chunk of each gradient, the chunks DTensor's `Shard(0)` assigns (chunk
    size ceil(n / ranks), trimmed to the parameter's local rows). hybrid_shard then all-reduces over the
    replicas; replicate only all-reduces. Gradients are divided by the dp size first (an average, as `Partial("avg")`).
    """
    shapes = [full.shape for _, full in bucket]
    local_rows = [param.to_local().shape[0] for param, _ in bucket]
    replicate = mode == "replicate"
    shard_dim = mesh.ndim - 1  # (replicate, shard) for hybrid_shard
    ranks = 1 if replicate else mesh.size(shard_dim)
    chunks = [-(-shape[0] // ranks) for shape in shapes]
    widths = [chunk * math.prod(shape[1:]) for shape, chunk in zip(shapes, chunks)]
    first = bucket[0][1]
    flat = torch.zeros(ranks, sum(widths), dtype=first.dtype, device=first.device)
    del first
    offset = 0
    for shape, chunk, width in zip(shapes, chunks, widths):
        _, full = bucket.pop(0)  # the bucket's reference goes; `full` dies at the next iteration
        rows = full.reshape(shape[0], -1)
        for r in range(ranks):  # rank r's chunk; rows past the gradient stay zero (uneven last shards)
            lo, hi = r * chunk, min((r + 1) * chunk, shape[0])
            if lo < hi:
                flat[r, offset : offset + (hi - lo) * rows.shape[1]] = rows[lo:hi].reshape(-1)
        offset += width
    del full, rows
    flat.div_(mesh.size())
    if replicate:
        out = flat.view(-1)
        dist.all_reduce(out, group=mesh.get_group())
    else:
        out = torch.empty(flat.shape[1], dtype=flat.dtype, device=flat.device)
        dist.reduce_scatter_tensor(out, flat.view(-1), group=mesh.get_group(shard_dim))
        del flat
        if mode == "hybrid_shard":
            dist.all_reduce(out, group=mesh.get_group(0))
    return [
        piece.view(chunk, *shape[1:])[:rows]
        for piece, shape, chunk, rows in zip(out.split(widths), shapes, chunks, local_rows)
    ]


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
