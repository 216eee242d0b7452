"""Node-local checkpoints (`checkpoint.local_interval`): each rank's own state on its node's storage, so
that a crash costs the steps since the last local save, not those since the last durable checkpoint.

A copy holds what a durable checkpoint restores on that rank, for the same layout (never resharded),
under `<checkpoint.local_folder>/rank-<r>/step-<N>/` (`state.pt` and `record.json`: size, CRC-32, step,
layout, line of training). Saving is no collective: host buffers kept from save to save, then one
background thread per rank; nothing is fsynced, as a copy need outlive its process, not its node. A
resume loads the newest step every rank holds (`agree`) only when it is newer than the durable
checkpoint and every rank's copy reads and fits (`misfit`), else the durable one: never a mix. The
line id in `<checkpoint folder>/.node-local-line` keeps copies of a deleted folder from being resumed.
What a user sees and what it costs: docs/checkpoints.md#node-local-checkpoints.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import time
import uuid
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from titanlite.checkpoint.folders import checksum
from titanlite.config import Checkpoint

logger = logging.getLogger("titanlite")

SHM = Path("/dev/shm/titanlite")
"""Where node-local copies go by default: shared memory, the fastest storage every Linux node has."""
KEEP = 2
"""Complete copies kept per rank: the newest, and the one before it while the newest is written."""
STATE, RECORD = "state.pt", "record.json"
LINE_FILE = ".node-local-line"
_COMPLETE = re.compile(r"^step-(\d+)$")


def folder_of(cfg: Checkpoint, dump_folder: str) -> Path:
    """The node-local folder: `checkpoint.local_folder` (relative to the dump folder), else one under
    `SHM` named for the checkpoint folder's absolute path, so runs on one node never share one."""
    if cfg.local_folder:
        return Path(dump_folder) / cfg.local_folder
    root = os.path.abspath(Path(dump_folder) / cfg.folder)
    return SHM / hashlib.sha256(root.encode()).hexdigest()[:16]


def line_of(root: Path) -> str:
    """The id of the line of training of checkpoint folder `root` (module docstring), created if missing."""
    path = root / LINE_FILE
    if path.is_file() and (line := path.read_text().strip()):
        return line
    root.mkdir(parents=True, exist_ok=True)
    line = uuid.uuid4().hex
    tmp = root / f"{LINE_FILE}.{line}.tmp"
    tmp.write_text(line)
    os.rename(tmp, path)
    return line


def agree(newest: int, durable: int, device: torch.device) -> tuple[list[int], int]:
    """Collective: one all-gather of (this rank's newest usable local step or -1, rank 0's durable step);
    returns every rank's newest step, by rank, and rank 0's durable step."""
    if not dist.is_initialized():
        return [newest], durable
    mine = torch.tensor([newest, durable], dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return [int(row[0]) for row in rows], int(rows[0][1])


def _local(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the parameters' and optimizer state's), any other tensor as it is."""
    from torch.distributed.tensor import DTensor  # imported here: the preflight reads `folder_of` without it

    return value.to_local() if isinstance(value, DTensor) else value


def misfit(live: dict, saved: object, key: str = "") -> str | None:
    """Why the saved state `saved` cannot be loaded into this rank's state dict `live`: an entry missing
    or extra, or a tensor of another shape or dtype; None if it fits."""
    if not isinstance(saved, dict) or set(live) != set(saved):
        have = set(saved) if isinstance(saved, dict) else set()
        odd = sorted(map(str, (set(live) - have) or (have - set(live))))
        return f"its entries differ from this rank's at {key or 'the top'} ({', '.join(odd[:3])})"
    for k, value in live.items():
        name = f"{key}.{k}" if key else str(k)
        if isinstance(value, dict):
            if why := misfit(value, saved[k], name):
                return why
        elif isinstance(value, torch.Tensor):
            mine, other = _local(value), saved[k]
            if not isinstance(other, torch.Tensor) or (other.shape, other.dtype) != (mine.shape, mine.dtype):
                what = (
                    f"{tuple(other.shape)} {other.dtype}" if isinstance(other, torch.Tensor) else type(other).__name__
                )
                return f"{name!r} is {what}, this rank's is {tuple(mine.shape)} {mine.dtype}"
    return None


def restore(live: dict, saved: dict) -> None:
    """Load `saved` into `live` as DCP's load does: tensors in place, other values replaced (`misfit` first)."""
    for k, value in live.items():
        if isinstance(value, dict):
            restore(value, saved[k])
        elif isinstance(value, torch.Tensor):
            with torch.no_grad():
                _local(value).copy_(saved[k])
        else:
            live[k] = saved[k]


class _Summing:
    """The file object torch.save writes through: the CRC-32 and size of what it wrote, in one pass."""

    def __init__(self, f) -> None:
        self.f, self.crc, self.size = f, 0, 0

    def write(self, data) -> int:
        view = memoryview(data)
        self.crc = zlib.crc32(view, self.crc)
        self.size += view.nbytes
        return self.f.write(view)

    def flush(self) -> None:
        self.f.flush()


@dataclass
class LocalCopy:
    """A local copy as a resume reads it."""

    path: Path
    record: dict
    payload: dict
    """{"state": the manager's state dict, its tensors local, "rank_state": `rank_state.capture`'s dict}."""


class NodeLocal:
    """One rank's node-local copies: the background writer, and what a resume reads (module docstring)."""

    def __init__(self, folder: Path, rank: int) -> None:
        self.folder = folder / f"rank-{rank:05d}"
        self.record: dict = {}
        """What every copy records besides its step, size and checksum (set by the manager's resume)."""
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="titanlite-local-save")
        self._writing: Future | None = None
        self._writing_step = -1
        self._buffers: dict[str, torch.Tensor] = {}  # host copies of the tensors by entry (page-locked on CUDA)
        self._pinned = False  # the buffers are page-locked: copied without blocking, waited for by the writer
        self._failing = False
        self._slow_warned = False

    def step_dir(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    # --- saving -----------------------------------------------------------------------------------------

    def save(self, step: int, state: dict, rank_state: dict) -> None:
        """Copy `state` (the manager's state dict) and `rank_state` to host memory now and write them in the
        background; a write of the previous save still running is waited for first (its buffers are reused)."""
        self._wait_for_write(step)
        staged = self._stage(state, "")
        ready = None
        if self._pinned:
            ready = torch.cuda.Event()
            ready.record()  # after the copies on the current stream: the writer waits for it
        payload = {"state": staged, "rank_state": copy.deepcopy(rank_state)}
        self._writing_step = step
        self._writing = self._pool.submit(self._write, step, payload, ready)

    def _stage(self, value, key: str):
        """`value` with every tensor copied into this rank's host buffer of its entry `key` (allocated at the
        first save: a fresh copy each time would fault its pages in again), other values deep-copied."""
        if isinstance(value, torch.Tensor):
            value = _local(value).detach()
            buffer = self._buffers.get(key)
            if buffer is None or (buffer.shape, buffer.dtype) != (value.shape, value.dtype):
                self._pinned = value.device.type == "cuda"
                buffer = self._buffers[key] = torch.empty(value.shape, dtype=value.dtype, pin_memory=self._pinned)
            buffer.copy_(value, non_blocking=self._pinned)
            return buffer
        if isinstance(value, dict):
            return {k: self._stage(v, f"{key}/{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._stage(v, f"{key}/{i}") for i, v in enumerate(value))
        return copy.deepcopy(value)

    def _wait_for_write(self, step: int | None = None) -> None:
        """Wait for the write in flight; `step`: the save that waits for it, which says so once per run."""
        if self._writing is None:
            return
        if step is not None and not self._writing.done() and not self._slow_warned:
            self._slow_warned = True
            logger.warning(
                f"checkpoint: the node-local save of step {self._writing_step} is still being written at step "
                f"{step}; waiting for it (a local save takes longer than checkpoint.local_interval steps)"
            )
        self._writing.result()
        self._writing = None

    def _write(self, step: int, payload: dict, ready) -> None:
        """The writer thread: `step-N.partial`, then `step-N`, then pruning (module docstring)."""
        partial = self.folder / f"step-{step}.partial"
        try:
            if ready is not None:
                ready.synchronize()
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
            start = time.perf_counter()
            with open(partial / STATE, "wb") as f:
                out = _Summing(f)
                torch.save(payload, out)
            seconds = round(time.perf_counter() - start, 4)
            record = {**self.record, "step": step, "size": out.size, "crc32": f"{out.crc:08x}", "seconds": seconds}
            (partial / RECORD).write_text(json.dumps(record))
            shutil.rmtree(self.step_dir(step), ignore_errors=True)  # a copy of another line's step N
            os.rename(partial, self.step_dir(step))
        except Exception as e:  # whatever a write meets (a full disk is a RuntimeError in torch.save)
            shutil.rmtree(partial, ignore_errors=True)
            if not self._failing:
                logger.warning(
                    f"checkpoint: the node-local save of step {step} to {self.folder} failed "
                    f"({type(e).__name__}: {e}); training goes on, and so do the durable checkpoints"
                )
            self._failing = True
            return
        if self._failing:
            logger.info(f"checkpoint: node-local saves to {self.folder} succeed again (step {step})")
            self._failing = False
        for old in self.steps()[:-KEEP]:
            shutil.rmtree(self.step_dir(old), ignore_errors=True)

    # --- reading ----------------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """The steps of this rank's complete copies, ascending."""
        if not self.folder.is_dir():
            return []
        return sorted(int(m[1]) for entry in self.folder.iterdir() if (m := _COMPLETE.match(entry.name)))

    def _record(self, step: int) -> dict | None:
        """The record of the copy of `step` when it reads and its state file has the recorded size."""
        try:
            record = json.loads((self.step_dir(step) / RECORD).read_text())
            return record if (self.step_dir(step) / STATE).stat().st_size == record["size"] else None
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def newest(self, unfit: Callable[[dict], str | None]) -> tuple[int, tuple[int, str] | None]:
        """The step of the newest complete copy that this run may resume (cheap checks: its record reads, its
        state file has the recorded size, and `unfit(record)`, why another run's copy is not this one's, is
        None), or -1; and (step, why) of the newest copy passed over, if any."""
        passed: tuple[int, str] | None = None
        for step in reversed(self.steps()):
            record = self._record(step)
            why = f"its {RECORD} does not read or its {STATE} is not of its size" if record is None else unfit(record)
            if why is None:
                return step, passed
            passed = passed or (step, why)
        return -1, passed

    def read(self, step: int) -> tuple[LocalCopy | None, str | None]:
        """The copy of `step`, its CRC-32 checked; or None and why it cannot be read."""
        path = self.step_dir(step)
        record = self._record(step)
        if record is None:
            return None, f"no complete copy of step {step} in {self.folder}"
        try:
            if (actual := checksum(path / STATE)) != record["crc32"]:
                return None, f"{path / STATE} has CRC-32 {actual}, its record says {record['crc32']} (corrupted)"
            payload = torch.load(path / STATE, weights_only=True, mmap=True)
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
            return None, f"cannot read {path / STATE} ({type(e).__name__}: {e})"
        return LocalCopy(path, record, payload), None

    # --- deleting ---------------------------------------------------------------------------------------

    def keep_only(self, step: int | None) -> None:
        """Delete every copy but that of `step` (None: all), and what interrupted writes left."""
        self._wait_for_write()
        if not self.folder.is_dir():
            return
        for entry in self.folder.iterdir():
            if step is None or entry != self.step_dir(step):
                shutil.rmtree(entry, ignore_errors=True)

    def remove_all(self) -> None:
        """Delete this rank's copies and its folder, and the node's folder once it is empty."""
        self.keep_only(None)
        shutil.rmtree(self.folder, ignore_errors=True)
        try:
            self.folder.parent.rmdir()
        except OSError:
            pass  # another rank's copies are still there, or the folder is gone already

    def close(self) -> None:
        """Wait for the write in flight."""
        self._wait_for_write()
        self._pool.shutdown(wait=True)
