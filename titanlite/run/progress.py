"""A rank's side of the launcher's hang watchdog (`hang_watchdog.py`): where it is, and its stack on demand.

Under the launcher (which sets `PROGRESS_DIR_ENV`) each rank keeps one small file, `rank<r>.progress`, that
it rewrites in place after every step and when it enters a phase that may outlast a step (a checkpoint
save, validation): `<step> <phase> <beat>`. A rewrite costs one `pwrite` of a few bytes; the launcher reads
the files about once a second. It also registers `faulthandler` on `STACK_SIGNAL`, writing every thread's
Python stack to `rank<r>.stack`: a C-level handler, so it dumps even while the rank's main thread is
blocked inside a collective, and a rank stopped by SIGSTOP dumps where it stopped once continued.
Alone (no launcher) it does nothing.
"""

from __future__ import annotations

import faulthandler
import os
import signal
from pathlib import Path
from typing import Literal

PROGRESS_DIR_ENV = "TITANLITE_PROGRESS_DIR"
"""Set by the launcher for its ranks: the folder of their progress and stack files."""
STACK_SIGNAL = signal.SIGUSR2
"""The signal on which a rank writes its Python stacks (no other use in titanlite or torch elastic)."""
Phase = Literal["train", "checkpoint", "validation"]


def progress_file(folder: str | Path, rank: int) -> Path:
    return Path(folder) / f"rank{rank}.progress"


def stack_file(folder: str | Path, rank: int) -> Path:
    return Path(folder) / f"rank{rank}.stack"


class Progress:
    """This rank's progress file and stack dump (module docstring); `beat` does nothing without a launcher."""

    def __init__(self, rank: int) -> None:
        self._fd: int | None = None
        self._beats = 0
        folder = os.environ.get(PROGRESS_DIR_ENV)
        if not folder:
            return
        self._stacks = open(stack_file(folder, rank), "w")  # held open: faulthandler writes to its descriptor
        faulthandler.register(STACK_SIGNAL, file=self._stacks, all_threads=True, chain=False)
        self._fd = os.open(progress_file(folder, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def beat(self, step: int, phase: Phase = "train") -> None:
        """Record that this rank finished `step` (phase `train`) or entered `phase` after it."""
        if self._fd is None:
            return
        self._beats += 1
        record = f"{step} {phase} {self._beats}".ljust(48).encode()  # fixed width: no stale tail
        os.pwrite(self._fd, record, 0)

    def close(self) -> None:
        if self._fd is None:
            return
        faulthandler.unregister(STACK_SIGNAL)
        os.close(self._fd)
        self._stacks.close()
        self._fd = None


def read_progress(folder: str | Path, rank: int) -> tuple[int, str, int] | None:
    """(step, phase, beat) of a rank's last record, None before its first."""
    try:
        fields = progress_file(folder, rank).read_text().split()
        return int(fields[0]), fields[1], int(fields[2])
    except (OSError, IndexError, ValueError):
        return None
