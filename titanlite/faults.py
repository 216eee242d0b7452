"""Fault injection for tests: environment variables that make a run fail in a chosen way at a chosen point.

Every fault a test can inject is here; unset, none does anything. They drive the shipped path (`run_train.sh`,
the trainer's own step) into failures hard to cause for real. A step's faults are one `StepFaults`, read once
when the loop starts; every other fault is one function, called where it acts.

    TITANLITE_FAULT_EXIT_AT=k          the faulting rank exits abruptly (code 17) before step k
    TITANLITE_FAULT_SIGTERM_AT=k       the faulting rank sends itself SIGTERM before step k
    TITANLITE_FAULT_USER_ERROR_AT=k    the faulting rank alone raises a `UserError` before step k (bad
                                       input only it can see, such as an unreadable shard on its host)
    TITANLITE_FAULT_CRASH_AT=k         the faulting rank alone raises a `RuntimeError` (a bug) before step k
    TITANLITE_FAULT_HANG_AT=k          the faulting rank hangs in Python before step k (sleeps for ever: a
                                       deadlock; its peers wait in the step's first collective)
    TITANLITE_FAULT_RANK=r             the faulting rank of the five above (default 0)
    TITANLITE_FAULT_ONCE=<file>        the five above fire only if <file> does not exist yet (it is created
                                       first), so a restarted run goes on normally
    TITANLITE_FAULT_NAN_AT=k[,k2...]   the loss of those steps is made NaN (every rank)
    TITANLITE_FAULT_METRICS_DISK_FULL  set: every write of every metrics output fails as on a full disk
    TITANLITE_FAULT_KILL_AT=N          every rank SIGKILLs itself after `save(N)` returns (a crash between
                                       saves); `N:mid_save`: rank 0 SIGKILLs itself while finalising the
                                       save of step N, after all data is written and before the completion
                                       marker (a crash inside a save)
    TITANLITE_FAULT_SLOW_PURGE=s       each deletion of a retired checkpoint folder (`checkpoint/purge.py`)
                                       first waits s seconds, as deleting terabytes on a shared file
                                       system does
    TITANLITE_FAULT_TOKENIZE_KILL_AFTER=n  the tokenize tool SIGKILLs itself once it has written n shards
                                       (an interrupted tokenization, which the same command resumes)
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from titanlite.errors import UserError

if TYPE_CHECKING:
    from torch import Tensor

logger = logging.getLogger("titanlite")

PREFIX = "TITANLITE_FAULT_"
NAN_AT = PREFIX + "NAN_AT"
METRICS_DISK_FULL = PREFIX + "METRICS_DISK_FULL"
KILL_AT = PREFIX + "KILL_AT"
SLOW_PURGE = PREFIX + "SLOW_PURGE"
TOKENIZE_KILL_AFTER = PREFIX + "TOKENIZE_KILL_AFTER"


def _step(name: str) -> int | None:
    value = os.environ.get(PREFIX + name)
    return int(value) if value else None


def _claim_once(path: str | None) -> bool:
    """True if a fault may fire: no TITANLITE_FAULT_ONCE file (`path`), or we are the first to create it."""
    if not path:
        return True
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


@dataclass(frozen=True)
class StepFaults:
    """The faults of a rank's training steps, read from the environment once, when its loop starts: the
    rank faults (EXIT_AT, SIGTERM_AT, USER_ERROR_AT, CRASH_AT, HANG_AT, each claimed through ONCE when it
    fires) on the faulting rank (RANK), and the steps whose loss is made NaN (NAN_AT) on every rank. The
    loop calls `before_step` before it reads a step's batches and asks `nan_loss` which loss the step
    computes; the step itself knows nothing of them."""

    rank: int
    faulting: bool
    """Whether `rank` is the faulting rank of the rank faults."""
    exit_at: int | None = None
    sigterm_at: int | None = None
    user_error_at: int | None = None
    crash_at: int | None = None
    hang_at: int | None = None
    once: str | None = None
    nan_at: frozenset[int] = frozenset()

    @classmethod
    def from_env(cls, rank: int) -> StepFaults:
        """Rank `rank`'s step faults as the TITANLITE_FAULT_* variables set them now (none: none fires)."""
        nan_at = os.environ.get(NAN_AT) or ""
        return cls(
            rank=rank,
            faulting=rank == int(os.environ.get(PREFIX + "RANK", "0")),
            exit_at=_step("EXIT_AT"),
            sigterm_at=_step("SIGTERM_AT"),
            user_error_at=_step("USER_ERROR_AT"),
            crash_at=_step("CRASH_AT"),
            hang_at=_step("HANG_AT"),
            once=os.environ.get(PREFIX + "ONCE"),
            nan_at=frozenset(int(k) for k in nan_at.split(",") if k),
        )

    def before_step(self, step: int) -> None:
        """The rank faults of step `step`, on the faulting rank."""
        if not self.faulting:
            return
        rank = self.rank
        if step == self.exit_at and _claim_once(self.once):
            logger.error(f"fault injection: rank {rank} exits abruptly at step {step}")
            os._exit(17)
        if step == self.sigterm_at and _claim_once(self.once):
            os.kill(os.getpid(), signal.SIGTERM)
        if step == self.user_error_at and _claim_once(self.once):
            raise UserError(f"fault injection: rank {rank} found bad input at step {step}")
        if step == self.crash_at and _claim_once(self.once):
            raise RuntimeError(f"fault injection: rank {rank} crashed at step {step}")
        if step == self.hang_at and _claim_once(self.once):
            logger.error(f"fault injection: rank {rank} hangs at step {step}")
            while True:
                time.sleep(1)

    def nan_loss(self, step: int, loss_fn: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
        """The loss of step `step`: `loss_fn`, or `loss_fn` times NaN at a NAN_AT step."""
        if step not in self.nan_at:
            return loss_fn
        return lambda pred, labels: loss_fn(pred, labels) * float("nan")


def metrics_write() -> None:
    """Raise the full-disk error a metrics output's write meets (METRICS_DISK_FULL), if asked to."""
    if os.environ.get(METRICS_DISK_FULL):
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({METRICS_DISK_FULL})")


def checkpoint_kill(step: int, point: str) -> None:
    """SIGKILL this process at `point` ("after_save" or "mid_save") of the save of step `step` (KILL_AT)."""
    spec = os.environ.get(KILL_AT)
    if not spec:
        return
    at, _, where = spec.partition(":")
    if int(at) == step and (where or "after_save") == point:
        logger.warning(f"{KILL_AT}={spec}: killing this process ({point} of step {step})")
        os.kill(os.getpid(), signal.SIGKILL)


def slow_purge(path: Path) -> None:
    """Wait SLOW_PURGE seconds before `path` is deleted, if asked to."""
    if seconds := float(os.environ.get(SLOW_PURGE) or 0):
        logger.warning(f"{SLOW_PURGE}={seconds:g}: deleting {path.name} takes {seconds:g}s longer")
        time.sleep(seconds)


def tokenize_kill(shards_written: int) -> None:
    """SIGKILL the tokenize tool once it has written TOKENIZE_KILL_AFTER shards in this run, if asked to."""
    if shards_written == _step("TOKENIZE_KILL_AFTER"):
        os.kill(os.getpid(), signal.SIGKILL)
