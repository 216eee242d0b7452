"""SimpleFSDP's gather of one parameter (`ReplicateComputation`), its mixed precision, and the state every
gather of one wrapped model shares (`SimpleFSDPState`).

`ReplicateComputation` redistributes a sharded DTensor parameter to Replicate (an all-gather, in
`param_dtype`) and hands back the local tensor with `Partial("avg")` gradient placements, so autograd
reduces its gradient (in `reduce_dtype`) on the way back. Under tensor parallelism it gathers over the dp
dims only and hands back a DTensor on the tp mesh. How the gathers are installed on a model is
`simple_fsdp.py`; the eager reshard-after-forward that reads the state's recipes is `eager_reshard.py`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """`param_dtype`: the dtype weights are gathered (and computed) in; `reduce_dtype`: the dtype their
    gradients are reduced in. None keeps the parameter's own dtype."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


Recipe = tuple["ReplicateComputation", DTensor, torch.Size, tuple[int, ...]]
"""(the gather, its sharded parameter, the gathered tensor's shape and stride): how to gather it again."""


@dataclass
class SimpleFSDPState:
    """What every gather of one SimpleFSDP-wrapped model reads, owned by that model (`data_parallel`
    creates it; `simple_fsdp.simple_fsdp_states` reaches it). Two wrapped models in one process never see
    each other's modes.

    The two flags are read while Dynamo traces (it guards on them, so a graph traced in one mode is not
    reused in the other); the tables belong to the eager reshard-after-forward (`eager_reshard.py`).
    """

    sharded_view: bool = False
    """Attribute access returns the sharded parameters instead of gathering them (`viewing_shards`)."""
    unreduced: bool = False
    """Gathers route their gradients to their sinks instead of reducing them (`routing_to_sinks`)."""
    gathered: weakref.WeakValueDictionary[int, torch.Tensor] = field(default_factory=weakref.WeakValueDictionary)
    """Gathered outputs of the running forward, by id (weak: an entry lives as long as the tensor)."""
    recipes: dict[int, Recipe] = field(default_factory=dict)
    """How to gather each of `gathered` again, by the same id."""

    @contextlib.contextmanager
    def viewing_shards(self) -> Iterator[None]:
        """Inside, `module.weight` is the sharded DTensor: for code that walks modules by attribute
        (torch's `get_state_dict`/`set_state_dict` resolve names with `getattr`), which would otherwise
        all-gather every parameter just to name it."""
        previous, self.sharded_view = self.sharded_view, True
        try:
            yield
        finally:
            self.sharded_view = previous

    @contextlib.contextmanager
    def routing_to_sinks(self) -> Iterator[None]:
        """Inside, gathers route their gradients to the sinks (`make_sink` first) instead of reducing them:
        graphs traced now hold no gradient reductions."""
        previous, self.unreduced = self.unreduced, True
        try:
            yield
        finally:
            self.unreduced = previous

    def forget_gathered(self) -> None:
        """Drop the running forward's recipes (its saved tensors hold what backward needs)."""
        self.recipes.clear()
        self.gathered.clear()


class WireFormat(Protocol):
    """Gathers a parameter in another format than the training dtype (float8 bits or raw bytes:
    `float8_gather.py`), without autograd (`gather_bytes`): the caller attaches the gradient's way back
    (`ReduceToShard`, the unreduced sink, or the float8 layer's own function). A flat gather of several
    parameters (`block_prefetch`) packs each one's `shard_bytes` and unpacks it with `from_bytes`."""

    itemsize: int
    """Bytes per element on the wire."""

    def gather(self, gather: ReplicateComputation, x: DTensor) -> torch.Tensor: ...

    def shard_bytes(self, x: DTensor) -> torch.Tensor:
        """This rank's shard of `x` as uint8, `itemsize` bytes per element."""
        ...

    def from_bytes(self, data: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The gathered weight of `shape` from its gathered bytes, one row of `data` per row of it."""
        ...


class ReplicateComputation(nn.Module):
    """Gathers one sharded DTensor parameter to a full (per-tp-shard) tensor for compute."""

    def __init__(
        self,
        state: SimpleFSDPState,
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
        self.state = state
        self.dp_mesh, self.mode, self.mp = dp_mesh, mode, mp_policy
        self.tp_mesh, self.tp_placements = tp_mesh, tp_placements
        self.tp_local_shape, self.global_shape, self.global_stride = tp_local_shape, global_shape, global_stride
        self.dp_placements = dp_placements(mode)
        self.replicated = tuple(Replicate() for _ in self.dp_placements)
        self.grad_placements = tuple(Partial("avg") for _ in self.dp_placements)
        self.reshard_after_forward = False
        self.sink: torch.Tensor | None = None
        """Gradient accumulation leaf of `routing_to_sinks` mode (zero strides: one element of storage)."""
        self.step_cache: Callable[[ReplicateComputation, DTensor], torch.Tensor] | None = None
        """Set inside `kept_gathers.kept_gathers`: hands out `kept` instead of gathering."""
        self.kept: torch.Tensor | None = None
        """This step's gathered weight, inside `kept_gathers.kept_gathers`."""
        self.on_sink_grad: Callable[[ReplicateComputation], None] | None = None
        """Called after each backward's accumulation into the sink (the step's reduction starts buckets)."""
        self.wire: WireFormat | None = None
        """Set when the weight travels in another format than the training dtype (float8 bits, or raw
        bytes): every gather of it goes through `gathered`."""

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

    def gather_bytes(self, local: torch.Tensor, shape: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
        """The dp all-gather of this rank's `local` part (a wire format's bytes) of a tensor of global
        `shape` and `stride`, sharded as the parameter is."""
        dt = DTensor.from_local(local, self.dp_mesh, self.dp_placements, run_check=False, shape=shape, stride=stride)
        return dt.redistribute(placements=self.replicated).to_local()

    def gathered_itemsize(self, x: DTensor) -> int:
        """Bytes each element of `x` takes gathered: its wire format's, else the param dtype's."""
        return self.wire.itemsize if self.wire is not None else (self.mp.param_dtype or x.dtype).itemsize

    def gathered(self, x: DTensor) -> torch.Tensor:
        """The gathered weight without autograd, in its wire format when it has one."""
        with torch.no_grad():
            return self._gather_local(x) if self.wire is None else self.wire.gather(self, x)

    def replicate_compute(self, x: DTensor) -> torch.Tensor:
        if self.wire is None:
            return self._as_tp(self._gather_local(x))
        full = self.gathered(x)
        if x.requires_grad and torch.is_grad_enabled():
            full = ReduceToShard.apply(full, x, self)
        return self._as_tp(full)

    def gather_unreduced(self, x: DTensor) -> torch.Tensor:
        """The same gather, whose gradient accumulates in `self.sink` instead of being reduced."""
        assert self.sink is not None, "step_reduction.unreduced sets up the sinks before the forward"
        return self._as_tp(RouteGradient.apply(self.gathered(x), self.sink))

    def reduce_to_shard(self, grad: torch.Tensor, like: ShardMeta) -> DTensor:
        """A gathered weight's gradient reduced to the shard `like` describes, as the gather's own backward
        does: cast to the reduce dtype, averaged over the data-parallel dims (reduce-scatter on a sharded
        dim, all-reduce on a replicated one), cast back to the parameter's dtype."""
        grad = grad.to(self.mp.reduce_dtype or like.dtype)
        partial = DTensor.from_local(
            grad, self.dp_mesh, self.grad_placements, run_check=False, shape=grad.shape, stride=grad.stride()
        )
        local = partial.redistribute(self.dp_mesh, self.dp_placements).to_local().to(like.dtype)
        return DTensor.from_local(
            local, like.mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride
        )

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
        if self.state.unreduced and x.requires_grad and torch.is_grad_enabled():
            out = self.gather_unreduced(x)
        else:
            out = self.replicate_compute(x)
        if self.reshard_after_forward and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            root = out._base if out._is_view() else out
            self.state.gathered[id(root)] = root
            self.state.recipes[id(root)] = (self, x, out.shape, out.stride())
        return out


class RouteGradient(torch.autograd.Function):
    """Identity on a gathered weight whose gradient goes to `sink` (autograd casts it to the sink's dtype
    and accumulates it there across backwards) rather than back through the gather's reduction."""

    @staticmethod
    def forward(ctx: Any, full: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
        return full.view_as(full)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, grad


@dataclass(frozen=True)
class ShardMeta:
    """What a sharded parameter's gradient must look like (`ReplicateComputation.reduce_to_shard`)."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, x: DTensor) -> ShardMeta:
        return cls(x.device_mesh, tuple(x.placements), x.shape, x.stride(), x.dtype)


class ReduceToShard(torch.autograd.Function):
    """Identity on a weight gathered without autograd (kept for a step, `kept_gathers`; gathered in a wire
    format); backward reduces its gradient to the sharded parameter `x` (`ReplicateComputation.reduce_to_shard`)."""

    @staticmethod
    def forward(ctx: Any, full: torch.Tensor, x: DTensor, gather: ReplicateComputation) -> torch.Tensor:
        ctx.gather, ctx.like = gather, ShardMeta.of(x)
        return full.view_as(full)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, DTensor, None]:
        return None, ctx.gather.reduce_to_shard(grad, ctx.like), None


def dp_placements(mode: str) -> tuple[Placement, ...]:
    """The data-parallel placements of a parameter under `mode`."""
    return {"fully_shard": (Shard(0),), "replicate": (Replicate(),), "hybrid_shard": (Replicate(), Shard(0))}[mode]


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))
