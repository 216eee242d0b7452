"""The goodput ledger: where a job's wall time went, over every restart and launch in its dump folder.

`<dump_folder>/goodput.jsonl` holds intervals of wall time, one JSON object per line
(`{"id", "start", "end", "seconds": {"productive": s, <badput category>: s, ...}, "step"}`), split into
productive step time and the categories of `BADPUT`. Two writers append, never at the same moment: rank 0
(`goodput_clock.GoodputClock`) and the launcher of rank 0's node (`launcher/launch_ledger.py`), each covering
what the other does not. A row is appended whole and fsync'd, and the last row of an id replaces the earlier
ones (it holds the whole interval, not an increment), so a kill -9 loses at most the time since the writer's
previous row and no second is counted twice. `totals` sums the ids' last rows: the launcher's line
(`Totals.line`) and the `goodput` metrics (`Totals.metrics`). The ledger's rules: docs/metrics.md.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

LEDGER_FILE = "goodput.jsonl"
PRODUCTIVE = "productive"
ATTEMPT_ENV = "TITANLITE_GOODPUT_ATTEMPT"
"""Set by the launcher for the ranks it starts: the launch, the attempt's number and its start time."""


@dataclass(frozen=True)
class Category:
    name: str
    title: str
    description: str


BADPUT = (
    Category(
        "startup",
        "Start-up",
        "From a launch's start to training, per attempt: launcher, preflight, rendezvous, imports, build, "
        "process group (a checkpoint's load apart).",
    ),
    Category("compile", "Compilation", "Each process's first step over a normal step (compilation, warm-up)."),
    Category("checkpoint_load", "Checkpoint loads", "Loading the checkpoint a run resumes from."),
    Category(
        "checkpoint_save",
        "Checkpoint saves",
        "Saves while training waited: a whole sync save, an async save's staging and the wait for the last.",
    ),
    Category("data_wait", "Data waits", "Waiting for the next batch."),
    Category(
        "recompute",
        "Recomputed steps",
        "Steps trained again: at or below a step the job trained before (resumed from an older checkpoint).",
    ),
    Category(
        "restart",
        "Restarts",
        "What a failure cost until the next attempt started (or the launch ended): the failing step, the "
        "failure's detection (a hang's window), stopping the ranks, the rendezvous.",
    ),
    Category(
        "other",
        "Other",
        "The rest: logging, validation, the loop's own work, the ranks' exit and the launcher's end.",
    ),
)
"""Where wall time that trains nothing new goes; each second of the job is in one category or productive."""
CATEGORIES = (PRODUCTIVE, *(c.name for c in BADPUT))


def ledger_path(dump_folder: str | Path) -> Path:
    return Path(dump_folder) / LEDGER_FILE


def read_rows(path: Path) -> list[dict]:
    """The ledger's rows in file order; a torn or foreign line (a kill mid-write) is skipped."""
    try:
        text = path.read_bytes().decode(errors="replace")
    except FileNotFoundError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if _well_formed(row):
            rows.append(row)
    return rows


def _well_formed(row: object) -> bool:
    """A row of the ledger's shape (a line damaged into other valid JSON is skipped like a torn one)."""
    if not isinstance(row, dict) or not isinstance(row.get("id"), str) or not isinstance(row.get("seconds"), dict):
        return False
    numbers = [row.get("start"), row.get("end"), row.get("step", 0), *row["seconds"].values()]
    return all(isinstance(n, (int, float)) and not isinstance(n, bool) for n in numbers)


def append_row(path: Path, row: dict) -> None:
    """Append `row` in one write and fsync it; a line left torn by a kill is ended first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        torn = size > 0 and os.pread(fd, 1, size - 1) != b"\n"
        data = memoryview((("\n" if torn else "") + json.dumps(row, separators=(",", ":")) + "\n").encode())
        while data:
            data = data[os.write(fd, data) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def latest(rows: list[dict]) -> dict[str, dict]:
    """Each interval's last row, by id (a later row of an id replaces the earlier ones)."""
    return {row["id"]: row for row in rows}


@dataclass(frozen=True)
class Totals:
    """Seconds per category (`CATEGORIES`) over a set of intervals."""

    seconds: dict[str, float]

    @staticmethod
    def zero() -> Totals:
        return Totals(dict.fromkeys(CATEGORIES, 0.0))

    @property
    def wall(self) -> float:
        return sum(self.seconds.values())

    @property
    def goodput(self) -> float:
        """Productive seconds over the wall time, 0..1 (0 before any time is recorded)."""
        return self.seconds.get(PRODUCTIVE, 0.0) / self.wall if self.wall > 0 else 0.0

    def plus(self, seconds: dict[str, float]) -> Totals:
        return Totals({c: self.seconds.get(c, 0.0) + seconds.get(c, 0.0) for c in CATEGORIES})

    def metrics(self) -> dict[str, float]:
        """`goodput` (fraction) and `badput/<category>` (seconds), as metrics.jsonl and TensorBoard log them."""
        return {"goodput": self.goodput, **{f"badput/{c.name}": self.seconds.get(c.name, 0.0) for c in BADPUT}}

    def line(self, where: str) -> str:
        """`goodput 91.2% of 312 s: startup 12.1 s, ... (<where>)`: the launcher's line at a launch's end."""
        parts = ", ".join(f"{c.name} {self.seconds.get(c.name, 0.0):.1f} s" for c in BADPUT)
        return f"goodput {100 * self.goodput:.1f}% of {self.wall:.0f} s: {parts} ({where})"


def totals(rows: list[dict]) -> Totals:
    """The job's totals: the sum over each interval's last row."""
    out = Totals.zero()
    for row in latest(rows).values():
        out = out.plus(row["seconds"])
    return out


def trained_step(rows: list[dict]) -> int:
    """The highest step the job's rows say was trained (0 for none)."""
    return max((int(row.get("step") or 0) for row in rows), default=0)


def last_end(rows: list[dict]) -> float | None:
    """The end of the newest interval that holds any time (a withdrawn row holds none)."""
    ends = [row["end"] for row in latest(rows).values() if any(row["seconds"].values())]
    return max(ends, default=None)


def process_started() -> float:
    """This process's start as a Unix time: its age from /proc (10 ms ticks) subtracted from now; now
    where /proc does not say. run_train.sh ends in an exec of the launcher, so for the launcher this is
    run_train.sh's start."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        age = 0.0
    return time.time() - max(age, 0.0)


@dataclass(frozen=True)
class Attempt:
    """One start of a job's ranks: the launch it belongs to, its number in the launch and its start."""

    launch: str
    number: int
    started: float

    def env(self) -> str:
        return f"{self.launch} {self.number} {self.started:.6f}"

    @staticmethod
    def current() -> Attempt:
        """The attempt the launcher started this process in (`ATTEMPT_ENV`); alone (without titanlite's
        launcher), an attempt of its own from the process's start."""
        try:
            launch, number, started = os.environ[ATTEMPT_ENV].split()
            return Attempt(launch, int(number), float(started))
        except (KeyError, ValueError):
            return Attempt(uuid.uuid4().hex[:12], 0, process_started())

    def rank0_id(self) -> str:
        return f"{self.launch}/rank0/{self.number}"
