"""The launcher's hang watchdog: a run whose ranks stop making progress is caught, named and restarted.

Most jobs that die at scale hang: one rank stops and the others wait for it in a collective until its
timeout. The launcher watches its ranks' progress files (`run/progress.py`); once no rank of this node
has moved for the window (`comm.hang_timeout_seconds`, or 3 x the longest step gap seen if longer; at
least `comm.init_timeout_seconds` in a checkpoint save or validation; armed by each attempt's first
step) every live rank writes its Python stacks to `<dump_folder>/hang/<n>/` (on CUDA NCCL's flight
recorder its trace to `<dump_folder>/comm_traces/`), and the rank whose stacks hold no collective (or
that was stopped) is named. The agent then restarts every rank when `comm.max_restarts` allows, else
the launch exits with `errors.EXIT_HUNG` (5). docs/failure_handling.md has the line and the files.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from titanlite.run.progress import STACK_SIGNAL, read_progress, stack_file

NCCL_PIPE_ENV = "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"
RELAXED_PHASES = ("checkpoint", "validation")
WAITING_FRAMES = ("torch/distributed/", "torch/autograd/")
"""Frames of a rank waiting for its peers: a collective, or a backward (whose collectives run in C++)."""
STACK_WAIT_SECONDS = 10.0


def nccl_pipe_env(folder: str | Path) -> dict[str, str]:
    """The ranks' NCCL debug pipe (CUDA only): a write to `<prefix><rank>.pipe` makes the flight recorder
    dump its trace where `build.nccl_env_defaults` points it (`<dump_folder>/comm_traces/`)."""
    return {NCCL_PIPE_ENV: str(Path(folder) / "nccl_pipe_rank_")}


@dataclass
class Hang:
    """What the launcher says of a hang: its one line names the ranks, the step and the stacks' folder."""

    idle_seconds: float
    where: str
    stuck: list[int]
    stopped: list[int]
    waiting: list[int]
    folder: Path

    def line(self) -> str:
        def ranks(rs: list[int]) -> str:
            return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))

        parts = []
        if self.stuck:
            stopped = " (a stopped process)" if self.stuck == self.stopped else ""
            parts.append(f"{ranks(self.stuck)}{stopped} made no progress for {self.idle_seconds:.0f} s {self.where}")
        if self.waiting:
            verb = "was" if len(self.waiting) == 1 else "were"
            waiting = f"{ranks(self.waiting)} {verb} waiting in a collective"
            if not self.stuck:
                waiting += f" for {self.idle_seconds:.0f} s {self.where} (the rank that stopped is on another node)"
            parts.append(waiting)
        return "; ".join(parts + [f"stacks in {self.folder}/"])


class HangWatchdog:
    """Watches the progress files of this node's ranks in `folder` (module docstring)."""

    def __init__(self, folder: Path, timeout: float, relaxed_timeout: float, dump_folder: str) -> None:
        self.folder, self.timeout, self.relaxed_timeout = folder, timeout, relaxed_timeout
        self.dump_folder = Path(dump_folder)
        self.reset()

    def reset(self) -> None:
        """A new attempt: forget the last one's records (and remove its files) and disarm."""
        for path in self.folder.glob("rank*"):
            path.unlink(missing_ok=True)
        self._records: dict[int, tuple[int, str, int]] = {}
        self._changed = 0.0
        self._longest_gap = 0.0
        self._armed = False

    def idle(self, ranks: list[int], now: float) -> float | None:
        """Seconds since any of `ranks` last moved, once that exceeds the window; else None."""
        records = {r: rec for r in ranks if (rec := read_progress(self.folder, r)) is not None}
        if records != self._records:
            relaxed = any(rec[1] in RELAXED_PHASES for rec in self._records.values())
            if self._armed and not relaxed:
                self._longest_gap = max(self._longest_gap, now - self._changed)
            self._records, self._changed, self._armed = records, now, bool(records)
            return None
        if not self._armed:
            return None
        window = max(self.timeout, 3 * self._longest_gap)
        if any(rec[1] in RELAXED_PHASES for rec in records.values()):
            window = max(window, self.relaxed_timeout)
        idle = now - self._changed
        return idle if idle >= window else None

    def capture(self, pids: dict[int, int], idle: float) -> Hang:
        """Have every rank in `pids` (rank -> pid) dump its stacks, copy them under the dump folder and
        name the ranks (module docstring)."""
        stopped = [r for r, pid in sorted(pids.items()) if _state(pid) == "T"]
        for pid in pids.values():
            _signal(pid, STACK_SIGNAL)
        for r in stopped:  # the dump signal is delivered when it continues, before any other instruction
            _signal(pids[r], signal.SIGCONT)
        if prefix := os.environ.get(NCCL_PIPE_ENV):
            for r in pids:
                _write_pipe(Path(f"{prefix}{r}.pipe"))
        stacks = self._wait_for_stacks(list(pids))
        out = self._next_folder()
        out.mkdir(parents=True)
        for r, text in stacks.items():
            state = "stopped (SIGSTOP)" if r in stopped else "running"
            (out / f"rank{r}.txt").write_text(f"rank {r}, pid {pids[r]}, {state}\n{text or '(no stack written)'}\n")
        waiting = [r for r in sorted(pids) if r not in stopped and any(f in stacks[r] for f in WAITING_FRAMES)]
        stuck = [r for r in sorted(pids) if r not in waiting]
        return Hang(idle, self._where(stuck or sorted(pids)), stuck, stopped, waiting, out)

    def _wait_for_stacks(self, ranks: list[int]) -> dict[int, str]:
        deadline = time.monotonic() + STACK_WAIT_SECONDS
        while True:
            stacks = {r: _read(stack_file(self.folder, r)) for r in ranks}
            if all(stacks.values()) or time.monotonic() > deadline:
                return stacks
            time.sleep(0.05)

    def _where(self, ranks: list[int]) -> str:
        """`at step N` (the step the ranks were in) or `in the checkpoint after step N`."""
        records = [self._records[r] for r in ranks if r in self._records]
        step, phase, _ = min(records)
        return f"at step {step + 1}" if phase == "train" else f"in the {phase} after step {step}"

    def _next_folder(self) -> Path:
        root = self.dump_folder / "hang"
        taken = {int(p.name) for p in root.glob("*") if p.name.isdigit()} if root.is_dir() else set()
        return root / str(max(taken, default=-1) + 1)


def _state(pid: int) -> str:
    """The process's state letter in /proc (`T`: stopped), "" if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _write_pipe(pipe: Path) -> None:
    """Ask NCCL's watchdog thread for its trace (a write to its named pipe; never blocks)."""
    try:
        fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # no pipe or no reader (a rank without NCCL)
        return
    try:
        os.write(fd, b"1\n")
    finally:
        os.close(fd)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return ""
