"""Step-scheduled profiling: Chrome traces and memory records of one step every `profile_freq` steps.

The trainer enters `Profiler(...)` around its step loop and calls `step()` after every optimizer step. With
`profiling.enable_profiling`, torch.profiler records steps `profile_freq`, `2 x profile_freq`, ... (after
one warm-up step; on resume the schedule follows the global step) and writes
`<dump_folder>/<save_traces_folder>/iteration_<N>/rank<r>_trace.json`; a cycle cut short is dropped.
`profiling.enable_memory_snapshot` dumps the CUDA allocator's history at the same steps and on an
out-of-memory error; on CPU, which has none, each recorded step writes `rank<r>_memory_timeline.json` from
`profile_memory=True` (torch's `export_memory_timeline` fails on multi-rank steps). A profile that cannot be
written is one warning and the end of profiling for the run (the policy of every output, `metrics/sinks.py`).
Files and how to read them: docs/metrics.md.
"""

from __future__ import annotations

import json
import logging
import os
from types import TracebackType

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile

from titanlite.config import Profiling

logger = logging.getLogger("titanlite")
MAX_MEMORY_EVENTS = 100_000
TOP_OPS = 10


class Profiler:
    """Context manager around the step loop; `step()` once per optimizer step. A no-op when disabled."""

    def __init__(self, cfg: Profiling, dump_folder: str, rank: int, device: torch.device, start_step: int = 0):
        self.cfg, self.rank, self.device, self.start_step = cfg, rank, device, start_step
        self.trace_dir = os.path.join(dump_folder, cfg.save_traces_folder)
        self.memory_dir = os.path.join(dump_folder, cfg.save_memory_snapshot_folder)
        self.cuda_history = cfg.enable_memory_snapshot and device.type == "cuda"
        self.cpu_timeline = cfg.enable_memory_snapshot and device.type != "cuda"
        if self.cpu_timeline and rank == 0:
            logger.info(
                "profiling: the memory snapshot is CUDA-only; on CPU each recorded step writes "
                "rank<r>_memory_timeline.json (allocated bytes over the step) instead"
            )
        self._prof: profile | None = None
        self._steps = 0
        self._closing = False
        self._failed = False  # a profile could not be written: no more are
        self.written: list[str] = []

    def _action(self, index: int) -> ProfilerAction:
        """Profiler schedule: record global steps that are multiples of profile_freq, warm up the step before."""
        step, freq = self.start_step + index + 1, self.cfg.profile_freq
        if step % freq == 0:
            return ProfilerAction.RECORD_AND_SAVE
        return ProfilerAction.WARMUP if (step + 1) % freq == 0 else ProfilerAction.NONE

    def __enter__(self) -> Profiler:
        if self.cfg.enable_profiling or self.cpu_timeline:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._prof = profile(
                activities=activities,
                schedule=self._action,
                on_trace_ready=self._on_trace_ready,
                profile_memory=self.cpu_timeline,
            )
            self._prof.__enter__()
        if self.cuda_history:
            torch.cuda.memory._record_memory_history(max_entries=MAX_MEMORY_EVENTS)
        return self

    def step(self) -> None:
        """Call after each optimizer step."""
        self._steps += 1
        if self._prof is not None:
            self._prof.step()
        step = self.start_step + self._steps
        if self.cuda_history and step % self.cfg.profile_freq == 0:
            self._dump_cuda_snapshot(f"iteration_{step}")

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._closing = True
        if self._prof is not None:
            self._prof.__exit__(exc_type, exc, tb)
        if self.cuda_history:
            if isinstance(exc, torch.OutOfMemoryError):
                self._dump_cuda_snapshot("oom")
            torch.cuda.memory._record_memory_history(enabled=None)

    def _path(self, root: str, folder: str, name: str) -> str:
        os.makedirs(os.path.join(root, folder), exist_ok=True)
        path = os.path.join(root, folder, f"rank{self.rank}_{name}")
        self.written.append(path)
        return path

    def _on_trace_ready(self, prof: profile) -> None:
        step = self.start_step + prof.step_num
        if self._closing or self._failed or step % self.cfg.profile_freq:
            return  # the profiler flushes an unfinished cycle on exit: not a whole step
        folder = f"iteration_{step}"
        # An exception escaping this callback leaves torch's profiler half-stopped, and its exit then
        # crashes the process: a profile that cannot be written is only a warning.
        try:
            if self.cfg.enable_profiling:
                prof.export_chrome_trace(self._path(self.trace_dir, folder, "trace.json"))
            if self.cpu_timeline:
                timeline = cpu_memory_timeline(prof)
                with open(self._path(self.memory_dir, folder, "memory_timeline.json"), "w") as f:
                    json.dump({"step": step, "rank": self.rank, **timeline}, f)
        except Exception as e:
            self._failed = True
            logger.warning(
                f"profiling: the profile of step {step} could not be written ({type(e).__name__}: {e}); no more "
                "profiles are written in this run, training continues"
            )
            return
        logger.info(
            f"profile of step {step} written to {self.trace_dir if self.cfg.enable_profiling else self.memory_dir}"
        )

    def _dump_cuda_snapshot(self, folder: str) -> None:
        if self._failed:
            return
        try:
            torch.cuda.memory._dump_snapshot(self._path(self.memory_dir, folder, "memory_snapshot.pickle"))
        except OSError as e:
            self._failed = True
            logger.warning(
                f"profiling: the memory snapshot {folder} could not be written ({e}); no more profiles are "
                "written in this run, training continues"
            )


def cpu_memory_timeline(prof: profile) -> dict:
    """CPU allocations of a recorded step from the profiler's memory records (`profile_memory=True`).

    Each operator's own allocations minus frees (`self_cpu_memory_usage`) are counted at its start, and
    records outside any operator as they happen; the running sum is the net allocated bytes since the
    step began. Built from the events alone, so collectives and in-place ops cannot upset it.
    """
    changes = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage)
    times, allocated, total = [], [], 0
    for t, delta in changes:
        total += delta
        times.append(round(t, 3))
        allocated.append(total)
    by_op = sorted(
        ((e.key, e.self_cpu_memory_usage) for e in prof.key_averages() if e.self_cpu_memory_usage > 0),
        key=lambda kv: -kv[1],
    )
    return {
        "device": "cpu",
        "times_us": times,
        "allocated_bytes": allocated,
        "peak_bytes": max(allocated, default=0),
        "top_allocating_ops": [[name, size] for name, size in by_op[:TOP_OPS]],
    }
