"""Layout-independent parameter initialisation.

A parameter's values are defined as a function of (seed, parameter name, element position) only: the
full tensor is viewed as rows, cut into fixed row chunks, and each chunk is drawn from its own CPU
generator seeded from (seed, name, chunk index). A rank that holds only a block of the parameter (a
DTensor shard under FSDP and/or TP) draws just the chunks overlapping its rows and keeps its columns.
So the initial weights are bit-identical on one process and on any mesh, on CPU and on CUDA, and no
rank ever materialises a full parameter.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import torch

CHUNK_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class InitSpec:
    kind: str
    """`normal`, `trunc_normal` or `ones`."""
    std: float = 0.02
    cutoff: float | None = None
    """Truncate at +-cutoff; None = torch's default bounds (-2, 2)."""


def _fill(t: torch.Tensor, spec: InitSpec, gen: torch.Generator) -> None:
    if spec.kind == "normal":
        torch.nn.init.normal_(t, 0.0, spec.std, generator=gen)
    elif spec.kind == "trunc_normal":
        a, b = (-spec.cutoff, spec.cutoff) if spec.cutoff is not None else (-2.0, 2.0)
        torch.nn.init.trunc_normal_(t, 0.0, spec.std, a, b, generator=gen)
    else:
        raise ValueError(f"unknown init kind {spec.kind!r}")


def local_block(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The tensor this rank holds and its offset in the full parameter."""
    # Imported here: the launcher's preflight imports the model families (their specs) without DTensor.
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if isinstance(param, DTensor):
        _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        return param.to_local(), tuple(offset)
    return param, (0,) * param.dim()


def _chunk_jobs(param: torch.Tensor, spec: InitSpec, seed: int, name: str) -> list[Callable[[], None]]:
    """One job per row chunk of `param` that this rank holds: draw the chunk, copy the local block of it."""
    local, offset = local_block(param)
    if spec.kind == "ones":
        return [torch.no_grad()(lambda: local.fill_(1.0))]
    if local.numel() == 0:
        return []
    if param.dim() > 2:
        # Stacked parameters (a mixture's experts) are drawn as [rows, the rest] and sharded by rows only.
        if tuple(local.shape[1:]) != tuple(param.shape[1:]):
            raise ValueError(f"{name}: layout-independent init shards parameters of 3 or more dims by rows only")
        # From the global shape only: indexing a DTensor parameter would be a collective, which a rank
        # holding no rows (more ranks than experts) never joins.
        local, offset, shape = local.flatten(1), (offset[0], 0), (param.shape[0], math.prod(param.shape[1:]))
    else:
        shape = tuple(param.shape)
    rows = shape[0]
    cols = shape[1] if len(shape) == 2 else 1
    row0, n_rows = offset[0], local.shape[0]
    col0 = offset[1] if len(shape) == 2 else 0
    n_cols = local.shape[1] if len(shape) == 2 else 1
    rows_per_chunk = max(1, CHUNK_ELEMENTS // cols)
    base = (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 62)
    local2d = local.view(n_rows, n_cols)

    @torch.no_grad()  # grad mode is per thread: the jobs may run on a pool's threads
    def job(chunk: int) -> None:
        start = chunk * rows_per_chunk
        block = torch.empty(min(rows_per_chunk, rows - start), cols, dtype=torch.float32)
        _fill(block, spec, torch.Generator().manual_seed(base + chunk))
        lo, hi = max(start, row0), min(start + block.shape[0], row0 + n_rows)
        local2d[lo - row0 : hi - row0].copy_(block[lo - start : hi - start, col0 : col0 + n_cols])

    first, last = row0 // rows_per_chunk, (row0 + n_rows - 1) // rows_per_chunk
    return [partial(job, chunk) for chunk in range(first, last + 1)]


@torch.no_grad()
def init_parameter_(param: torch.Tensor, spec: InitSpec, seed: int, name: str) -> None:
    """Initialise one parameter (or this rank's block of it), chunk after chunk."""
    for job in _chunk_jobs(param, spec, seed, name):
        job()


@torch.no_grad()
def init_parameters_(params: list[tuple[str, torch.Tensor, InitSpec]], seed: int, threads: int = 0) -> None:
    """Initialise many (name, parameter, spec) at once, their chunks drawn on `threads` CPU threads (0 =
    torch's intra-op thread count, which run_train.sh sets to the cores per rank).

    The CPU generator draws sequentially, so one thread fills about 200M values per second: a 70B model
    would take minutes. Chunks are independent (each has its own generator, and torch's kernels release
    the GIL), so threads divide the time and the values are the same as one thread's."""
    jobs = [job for name, param, spec in params for job in _chunk_jobs(param, spec, seed, name)]
    threads = min(threads or torch.get_num_threads(), len(jobs))
    if threads <= 1:
        for job in jobs:
            job()
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="titanlite-init") as pool:
        for future in [pool.submit(job) for job in jobs]:
            future.result()
