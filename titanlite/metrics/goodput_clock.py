"""Rank 0's interval of the goodput ledger (`goodput.py`): the trainer's time, split as it is spent.

The trainer marks the end of each piece of its work (`mark`), and the time since the previous mark goes to
that piece's category, so the pieces add up with nothing counted twice. A step is productive, or `recompute`
when the job trained it before; the process's first step beyond the later steps' mean is `compile`. A mark is
a clock read: no device sync, no collective. The interval starts when the launcher started the ranks
(`goodput.Attempt`), never before the ledger's newest interval ends; rank 0 appends it at the start, at each
log step (`flush`) and at the end, and a failed write is one warning (`sinks.Output`'s policy).
"""

from __future__ import annotations

import logging
import time

from titanlite.metrics.goodput import (
    CATEGORIES,
    LEDGER_FILE,
    PRODUCTIVE,
    Attempt,
    Totals,
    append_row,
    last_end,
    latest,
    ledger_path,
    read_rows,
    totals,
    trained_step,
)
from titanlite.metrics.sinks import Output

logger = logging.getLogger("titanlite")


class GoodputClock:
    """This process's interval of the ledger of `dump_folder` (module docstring); written by rank 0 only
    (`enabled`)."""

    def __init__(self, dump_folder: str, enabled: bool) -> None:
        attempt = Attempt.current()
        self.id = attempt.rank0_id()
        self.path = ledger_path(dump_folder)
        self.output = Output(LEDGER_FILE) if enabled else None
        rows: list[dict] = []
        if enabled:
            try:
                rows = [row for row in read_rows(self.path) if row["id"] != self.id]
            except OSError as e:
                logger.warning(f"metrics: cannot read {self.path} ({e}); goodput counts this run's time alone")
        self.before = totals(rows)
        """The job's time before this interval: the other intervals of the ledger."""
        self.trained = trained_step(rows)
        """The highest step the job trained before: steps up to it are `recompute`."""
        # Never before the newest interval's end: a second trainer of one process (in-process use) or a
        # process its launcher did not start does not count the time before it again.
        wall, now = time.time(), time.perf_counter()
        self.started = min(max(attempt.started, last_end(rows) or 0.0), wall)
        self._origin = now - (wall - self.started)
        self._last = self._origin
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        self._first: tuple[str, float] | None = None
        """(category, seconds) of the process's first step, split at `snapshot`."""
        self._later_steps, self._later_seconds = 0, 0.0
        self.last_step = 0
        self.missed_before = sum(row.get("missed_steps", 0) for row in latest(rows).values())
        """The replica group's missed steps the ledger's other intervals hold (`missed`)."""
        self.missed_steps = 0
        """The replica group's missed steps this interval learnt (`missed`); in its row when any."""

    def mark(self, category: str) -> float:
        """The time since the last mark was spent in `category`; returns now (`time.perf_counter`)."""
        now = time.perf_counter()
        self.seconds[category] += now - self._last
        self._last = now
        return now

    def step_done(self, step: int) -> None:
        """The time since the last mark trained `step`."""
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        category = "recompute" if step <= self.trained else PRODUCTIVE
        if self._first is None:
            self._first = (category, seconds)
        else:
            self.seconds[category] += seconds
            self._later_steps += 1
            self._later_seconds += seconds
        self.last_step = max(self.last_step, step)

    def missed(self, total: int) -> None:
        """The job has trained `total` steps without this replica group (it learnt so when it received a live
        group's state): its row holds those no other interval of the ledger holds, as `missed_steps`, so the
        ledger sums to the total."""
        self.missed_steps = max(total - self.missed_before, 0)

    def snapshot(self) -> dict[str, float]:
        """Seconds per category up to the last mark, the first step split into compile and a step."""
        out = dict(self.seconds)
        if self._first is not None:
            category, first = self._first
            normal = self._later_seconds / self._later_steps if self._later_steps else first
            compiled = max(first - normal, 0.0)
            out["compile"] += compiled
            out[category] += first - compiled
        return out

    def totals(self) -> Totals:
        """The job's totals up to the last mark: the ledger before this process, and this interval."""
        return self.before.plus(self.snapshot())

    def metrics(self) -> dict[str, float]:
        return self.totals().metrics()

    def row(self) -> dict:
        """This interval as its ledger row."""
        return {
            "id": self.id,
            "start": round(self.started, 3),
            "end": round(self.started + (self._last - self._origin), 3),
            "seconds": {c: round(s, 4) for c, s in self.snapshot().items()},
            "step": self.last_step,
            **({"missed_steps": self.missed_steps} if self.missed_steps else {}),
        }

    def flush(self) -> None:
        """Append this interval, as it is now, to the ledger (rank 0)."""
        if self.output is not None:
            row = self.row()
            self.output.write(lambda: append_row(self.path, row))
