"""SimpleFSDP's once-per-step gradient reduction: k backwards accumulate, one reduction per bucket.

Inside `unreduced(model)` each gathered weight's gradient accumulates unreduced and unsharded in its fp32 sink
(`ReplicateComputation.make_sink`), and the gradients are reduced once: one collective per bucket of about
`REDUCE_BUCKET_BYTES`, planned in backward order per (dp mesh, mode, reduce dtype). A bucket starts
asynchronously as soon as its gradients are final (in the backward marked last, `before_backward(True)`, or
at the `backwards`-th accumulation), packed in one copy (`torch._chunk_cat`). Leaving the context starts the
rest, waits for all in the same order on every rank and writes each averaged shard into `.grad`; a gradient
that arrives after its bucket started is reduced by a further bucket and added, so the result is exact.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from titanlite.parallelisms.data_parallel.replicate_compute import ReplicateComputation
from titanlite.parallelisms.data_parallel.simple_fsdp import parametrized, simple_fsdp_states

REDUCE_BUCKET_BYTES = 64 * 2**20
"""Unreduced gradients are reduced in buckets of about this many bytes (in the reduce dtype): one
collective per bucket."""

_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""`reduce_scatter_single` where torch has it (2.13 deprecates the older name, which torch 2.11 and 2.12
alone have), the same signature."""


@contextlib.contextmanager
def unreduced(model: nn.Module, backwards: int = 0) -> Iterator[Callable[[bool], None]]:
    """Backwards inside accumulate each parameter's gradient unreduced and unsharded; each is reduced
    once into `param.grad` (module docstring). Yields `before_backward(last)`; `backwards` (0 = not
    given) is how many backwards run inside, for callers that cannot mark the last one.

    For gradient accumulation: k backwards cost one reduction per parameter instead of k, at the price of
    holding the rank's gradients unsharded in fp32 until the reduction. The forward's all-gathers are
    unchanged. Leaving on an exception drops what accumulated.
    """
    reduction = StepReduction(parametrized(model), backwards)
    try:
        with contextlib.ExitStack() as routing:
            for state in simple_fsdp_states(model):
                routing.enter_context(state.routing_to_sinks())
            yield reduction.before_backward
    except BaseException:
        reduction.abandon()
        raise
    reduction.finish()


@dataclass
class _Bucket:
    mesh: DeviceMesh
    mode: str
    dtype: torch.dtype
    """The reduce (wire) dtype."""
    members: list[tuple[ReplicateComputation, DTensor]] = field(default_factory=list)
    pending: set[int] = field(default_factory=set)
    """ids of the members whose gradient is not final yet."""
    started: bool = False
    work: Any = None
    flat: torch.Tensor | None = None
    out: torch.Tensor | None = None
    layout: list[tuple[DTensor, torch.Size, int, int]] = field(default_factory=list)
    """(parameter, gradient shape, rows per rank, width per rank) of each packed member."""


class StepReduction:
    """The buckets of one `unreduced` context, started from the sinks' accumulation hooks (also one
    unit's gradients of one backward, for `block_prefetch`)."""

    def __init__(self, pairs: list[tuple[ReplicateComputation, DTensor]], backwards: int):
        self.backwards, self.last = backwards, False
        self.counts: dict[int, int] = {}
        self.bucket_of: dict[int, _Bucket] = {}
        self.buckets = self._plan(pairs)
        self.started: list[_Bucket] = []
        for gather, param in pairs:
            if gather.sink is None:
                gather.make_sink(param)
            gather.on_sink_grad = self.accumulated
        self.pairs = pairs

    def _plan(self, pairs: list[tuple[ReplicateComputation, DTensor]]) -> list[_Bucket]:
        """Buckets in backward order (reversed forward order), one list per (mesh, mode, dtype)."""
        buckets: list[_Bucket] = []
        open_: dict[tuple, tuple[_Bucket, int]] = {}
        for gather, param in reversed(pairs):
            dtype = gather.mp.reduce_dtype or param.dtype
            key = (gather.dp_mesh, gather.mode, dtype)
            nbytes = math.prod(gather.tp_local_shape or param.shape) * dtype.itemsize
            bucket, size = open_.get(key, (None, 0))
            if bucket is None or (bucket.members and size + nbytes > REDUCE_BUCKET_BYTES):
                bucket, size = _Bucket(gather.dp_mesh, gather.mode, dtype), 0
                buckets.append(bucket)
            bucket.members.append((gather, param))
            bucket.pending.add(id(gather))
            open_[key] = (bucket, size + nbytes)
            self.bucket_of[id(gather)] = bucket
            self.counts[id(gather)] = 0
        return buckets

    def before_backward(self, last: bool) -> None:
        self.last = last

    def all_started(self) -> bool:
        """Every bucket's reduction has started (its gradients were final)."""
        return all(b.started for b in self.buckets)

    def accumulated(self, gather: ReplicateComputation) -> None:
        key = id(gather)
        self.counts[key] += 1
        if not (self.last or (self.backwards and self.counts[key] >= self.backwards)):
            return
        bucket = self.bucket_of[key]
        bucket.pending.discard(key)
        if not bucket.pending and not bucket.started:
            self._start(bucket)

    def _start(self, bucket: _Bucket) -> None:
        """Pack the bucket's gradients (freeing the sinks' copies) and start its reduction."""
        bucket.started = True
        members = [(g, p, g.sink.grad) for g, p in bucket.members if g.sink is not None and g.sink.grad is not None]
        if not members:
            return
        for gather, _, _ in members:
            gather.sink.grad = None  # type: ignore[union-attr]
        mesh, mode = bucket.mesh, bucket.mode
        shard_dim = mesh.ndim - 1  # (replicate, shard) for hybrid_shard
        ranks = 1 if mode == "replicate" else mesh.size(shard_dim)
        fulls = [full for _, _, full in members]
        for (_, param, full), chunk_of in zip(members, (-(-f.shape[0] // ranks) for f in fulls)):
            width = chunk_of * math.prod(full.shape[1:])
            bucket.layout.append((param, full.shape, chunk_of, width))
        flat = torch.empty(ranks, sum(w for *_, w in bucket.layout), dtype=bucket.dtype, device=fulls[0].device)
        torch._chunk_cat(fulls, dim=0, num_chunks=ranks, out=flat)
        del members, fulls
        flat.div_(mesh.size())
        if mode == "replicate":
            bucket.out = flat.view(-1)
            bucket.work = dist.all_reduce(bucket.out, group=mesh.get_group(), async_op=True)
        else:
            bucket.out = torch.empty(flat.shape[1], dtype=flat.dtype, device=flat.device)
            bucket.work = _REDUCE_SCATTER(bucket.out, flat.view(-1), group=mesh.get_group(shard_dim), async_op=True)
        bucket.flat = flat  # alive until the collective is done with it
        self.started.append(bucket)

    def finish(self) -> None:
        """Start what no backward completed, wait for every bucket, write the gradients (then reduce any
        gradient that arrived after its bucket started)."""
        for bucket in self.buckets:
            if not bucket.started:
                self._start(bucket)
        self._complete(self.started)
        late = [(g, p) for g, p in self.pairs if g.sink is not None and g.sink.grad is not None]
        self._detach()
        if late:
            rest = StepReduction(late, 0)
            for bucket in rest.buckets:
                rest._start(bucket)
            rest._complete(rest.started)
            rest._detach()

    def _complete(self, buckets: list[_Bucket]) -> None:
        for bucket in buckets:
            bucket.work.wait()
            bucket.flat = None
            if bucket.mode == "hybrid_shard":
                bucket.work = dist.all_reduce(bucket.out, group=bucket.mesh.get_group(0), async_op=True)
        for bucket in buckets:
            if bucket.mode == "hybrid_shard":
                bucket.work.wait()
            assert bucket.out is not None
            for (param, shape, chunk, _), piece in zip(bucket.layout, bucket.out.split([w for *_, w in bucket.layout])):
                local = piece.view(chunk, *shape[1:])[: param.to_local().shape[0]]
                grad = DTensor.from_local(
                    local.to(param.dtype),
                    param.device_mesh,
                    param.placements,
                    run_check=False,
                    shape=param.shape,
                    stride=param.stride(),
                )
                param.grad = grad if param.grad is None else param.grad + grad
            bucket.out = None

    def abandon(self) -> None:
        """Drop what accumulated (started collectives keep their own buffers alive until done)."""
        for gather, _ in self.pairs:
            if gather.sink is not None:
                gather.sink.grad = None
        self._detach()

    def _detach(self) -> None:
        for gather, _ in self.pairs:
            gather.on_sink_grad = None
