"""A rank's batches from the run's data loader (`loader.py`), one reader per data-parallel replica: the ranks
of a replica (its tensor-, context- and pipeline-parallel ranks) train on the same batches, so only its first
rank reads them and the others receive them. It reads the mesh's coordinates only, no parallelism's state.

Without this every rank of a replica would read and tokenize the same documents: for an `hf://` dataset
that is the same shards streamed tp x pp times over the network, and for local data the same
tokenization on every rank. The reader is the replica's lowest global rank (pipeline rank 0, tensor rank
0), whose data loader state is the one a resume reads (`checkpoint/rank_state.py`: old rank `d * replica_width`);
the other ranks' loaders are built (a bad dataset is still reported before training) but never iterated,
so their saved loader state stays at its start and is never read. Each microbatch costs one broadcast of
its token ids, labels and positions over the replica's ranks ([3, local batch, seq_len] int64, on the
device the step runs on). The reader stacks them on the host (into page-locked memory on CUDA) and copies
them to the device without blocking: the host goes on to the step while the copy runs, as the loader's
pinned batches let it without tensor, context or pipeline parallelism (`data/batch.py`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from titanlite.data.batch import Batch
from titanlite.parallelisms.parallel_dims import ParallelDims


def replica_ranks(dims: ParallelDims) -> list[list[int]]:
    """The global ranks of each data-parallel replica, by dp rank."""
    replicas: list[list[int]] = [[] for _ in range(dims.dp)]
    for rank in range(dims.world_size):
        replicas[dims.dp_rank_of(rank)].append(rank)
    return replicas


def replica_batches(
    loader: Iterable, dims: ParallelDims, device: torch.device, shape: tuple[int, int], timeout_seconds: float
) -> Iterator[Batch]:
    """This rank's batches (`Batch`) of `shape` (local batch, seq_len): read from `loader` on the
    replica's reader, received from it elsewhere. Collective: every rank calls it, and takes as many
    batches as its replica's peers."""
    if dims.world_size == dims.dp or not dist.is_initialized():  # one rank per replica: it reads
        yield from loader
        return
    replicas = replica_ranks(dims)
    group, _ = dist.new_subgroups_by_enumeration(replicas, timeout=timedelta(seconds=timeout_seconds))
    rank = dist.get_rank()
    reader = replicas[dims.dp_rank_of(rank)][0]
    batches = iter(loader) if rank == reader else None
    rows_shape = (len(Batch._fields), *shape)
    while True:
        if batches is not None:
            # A fresh pinned buffer each time: the caching host allocator keeps it until its copy is done.
            staged = torch.empty(rows_shape, dtype=torch.long, pin_memory=device.type == "cuda")
            rows = torch.stack(next(batches), out=staged).to(device, non_blocking=True)
        else:
            rows = torch.empty(rows_shape, dtype=torch.long, device=device)
        dist.broadcast(rows, src=reader, group=group)
        yield Batch(*rows)
