"""Stragglers: the rank whose own work is slower than its peers', named although collectives hide it.

Under synchronous collectives every rank's step takes the same wall time: a slow rank makes the others
wait for it at each collective. So each rank measures the time it did NOT spend waiting: a sampler thread
looks at the main thread's Python stack every `SAMPLE_SECONDS` and counts the time since its last look as
waiting (a frame that blocks on a collective: `wait_tensor`, or a call in `distributed_c10d.py`) or as the
rank's own (compute, data, host code; not time the host gave another process). A rank stopped part of
the time counts the stop as its own at its next look, while its peers are seen waiting for it. On log
steps one all-gather of a float per rank brings the own seconds per step together: `straggler/ratio` is
the slowest over the others' median, `straggler/slowest_rank` its rank (each log step's window). A rank is
named in the log, once a streak, when its own time summed over the last `PERSISTENT` log steps exceeds the
others' median by `metrics.straggler_threshold` (the first step's window judges no one). On CUDA, where
the host seldom waits inside a collective, the measure sees a slow host, not a slow device.
"""

from __future__ import annotations

import logging
import statistics
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from types import FrameType

import torch
import torch.distributed as dist

from titanlite import torch_support

logger = logging.getLogger("titanlite")

SAMPLE_SECONDS = 0.01
PERSISTENT = 3
"""Log steps whose own times, summed, name a straggler: one slow window is noise (a page-cache miss, a
neighbour's burst), three are a pattern."""
WAIT_FUNCTIONS = frozenset({"wait_tensor", "wait"})
WAIT_FILES = ("distributed_c10d.py",)


def waiting(frame: FrameType | None) -> bool:
    """Whether a stack (innermost frame first) blocks on a collective."""
    while frame is not None:
        code = frame.f_code
        if code.co_name in WAIT_FUNCTIONS and "torch/distributed/" in code.co_filename:
            return True
        if code.co_filename.endswith(WAIT_FILES):
            return True
        frame = frame.f_back
    return False


class OwnTime:
    """Seconds of the main thread's own work (not waiting in a collective), sampled by a daemon thread.

    The time the thread was ready to run but the operating system ran another (its run-queue delay, Linux
    schedstat) is left out: a busy shared host is not this rank's slowness, while a stopped process is not
    on the run queue, so its stop still counts."""

    def __init__(self) -> None:
        main = threading.main_thread()
        self._main = main.ident
        self._schedstat = f"/proc/self/task/{main.native_id}/schedstat"
        self._own = 0.0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._sample, name="titanlite-own-time", daemon=True)
        self._thread.start()

    def _run_delay(self) -> float:
        """The main thread's seconds on the run queue so far (0 where the kernel does not say)."""
        try:
            with open(self._schedstat) as f:
                return int(f.read().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return 0.0

    def _sample(self) -> None:
        last, delayed = time.perf_counter(), self._run_delay()
        while not self._stop.wait(SAMPLE_SECONDS):
            now, delay = time.perf_counter(), self._run_delay()
            frame = sys._current_frames().get(self._main)  # type: ignore[arg-type]
            if not waiting(frame):
                with self._lock:
                    self._own += max(now - last - (delay - delayed), 0.0)
            last, delayed = now, delay

    def take(self) -> float:
        """Own seconds since the last call."""
        with self._lock:
            own, self._own = self._own, 0.0
        return own

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclass(frozen=True)
class StragglerStats:
    slowest_rank: int
    ratio: float
    """The slowest rank's own seconds per step over the median of the other ranks'."""

    def metrics(self) -> dict[str, float]:
        return {"straggler/slowest_rank": self.slowest_rank, "straggler/ratio": self.ratio}


class StragglerMeter:
    """Every rank's own time per step at log steps (module docstring); `measure` is collective."""

    def __init__(self, threshold: float, device: torch.device) -> None:
        self.threshold, self.device = threshold, device
        self.own = OwnTime() if threshold > 0 and dist.is_initialized() and dist.get_world_size() > 1 else None
        self._recent: deque[list[float]] = deque(maxlen=PERSISTENT)
        self._named: int | None = None
        self._first = True

    def restart(self) -> None:
        """Forget what was measured so far (start-up and loading are nobody's straggling)."""
        if self.own is not None:
            self.own.take()
        self._recent.clear()
        self._first = True

    def measure(self, steps: int, step: int) -> StragglerStats | None:
        """Gather every rank's own seconds per step over the `steps` steps up to `step` (one small all-gather);
        rank 0's log names a rank slower than the threshold over the last `PERSISTENT` calls together."""
        if self.own is None:
            return None
        mine = torch.tensor([self.own.take() / max(steps, 1)], dtype=torch.float32, device=self.device)
        every = torch.empty(dist.get_world_size(), dtype=torch.float32, device=self.device)
        torch_support.flat_all_gather()(every, mine)
        seconds = every.tolist()
        if self._first:  # the first step's window (compilation, first batches) judges no one
            self._first = False
            return slowest(seconds)
        self._recent.append(seconds)
        if len(self._recent) == PERSISTENT:
            # Summed over the windows: one window's burst (a neighbour, a page-cache miss) is diluted.
            total = slowest([sum(column) for column in zip(*self._recent)])
            if total.ratio < self.threshold:
                self._named = None
            elif self._named != total.slowest_rank:
                self._named = total.slowest_rank
                if dist.get_rank() == 0:
                    logger.warning(
                        f"straggler at step {step}: rank {total.slowest_rank} is {total.ratio:.2f}x slower than "
                        f"the others' median over the last {PERSISTENT} log steps (its own work per step, not "
                        "waiting in collectives)"
                    )
        return slowest(seconds)

    def close(self) -> None:
        if self.own is not None:
            self.own.close()


def slowest(seconds: list[float]) -> StragglerStats:
    """The rank with the most own seconds, and their ratio to the other ranks' median (not the median of
    all: of two ranks, the slower would be compared with itself half-way)."""
    rank = max(range(len(seconds)), key=seconds.__getitem__)
    median = statistics.median(seconds[:rank] + seconds[rank + 1 :])
    return StragglerStats(rank, seconds[rank] / median if median > 0 else 1.0)
