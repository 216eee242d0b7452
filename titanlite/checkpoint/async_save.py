"""Async checkpoint saves (`checkpoint.async_mode`): staging and the background writer.

Protocol: an async save stages a CPU copy of the state (so training may change the parameters at once)
and writes it from a background thread over a gloo process group of its own: a second thread must not
issue collectives on the training process group. That group's collectives wait for every rank's file
writes (minutes for a large checkpoint on a shared file system), so its timeout is
`comm.init_timeout_seconds`, the one for long phases, not the per-step `train_timeout_seconds`, nor
gloo's default of 30 minutes, which would hide a dead peer that long. The manager keeps at most one save in flight
(`Pending`) and finalises it (marker, rename, pruning, on rank 0) when it polls a finished one, at its
next `save()` or in `close()`. `async_with_pinned_mem` stages into reused pinned host memory on CUDA; on
CPU it is plain `async`.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from titanlite.config import Comm

logger = logging.getLogger("titanlite")


@dataclass
class Pending:
    """An async save in flight."""

    step: int
    path: Path
    info: dict
    future: Future
    started: float


class AsyncWriter:
    """The writer thread's process group and, for `async_with_pinned_mem` on CUDA, the pinned stager."""

    def __init__(self, async_mode: str, comm: Comm, device: torch.device, rank: int) -> None:
        timeout = timedelta(seconds=comm.init_timeout_seconds)
        self.pg = dist.new_group(backend="gloo", timeout=timeout) if dist.is_initialized() else None
        self.stager: DefaultStager | None = None
        if async_mode == "async_with_pinned_mem":
            if device.type == "cuda":
                self.stager = DefaultStager(
                    StagingOptions(
                        use_pinned_memory=True,
                        use_shared_memory=False,
                        use_async_staging=False,
                        use_non_blocking_copy=False,
                    )
                )
            elif rank == 0:
                logger.info("checkpoint.async_mode async_with_pinned_mem: no pinned memory on CPU, using async")

    def start(self, state: dict, writer) -> Future:
        """Stage `state` and start writing it with `writer` in the background."""
        return dcp.async_save(state, storage_writer=writer, process_group=self.pg, async_stager=self.stager)

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
            self.stager = None
