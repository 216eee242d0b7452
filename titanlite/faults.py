"""Fault injection for tests: environment variables that make a run fail in a chosen way at a chosen point.

Every fault a test can inject is here, read where the fault acts through one function each; unset, each
function does nothing. They exist so the tests can drive the shipped path (`run_train.sh`, the trainer's
own step) into a failure that is hard to cause for real: a rank dying mid-run, a signal at a known step,
a full disk where no small disk can be mounted, a kill inside a checkpoint save.

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
from pathlib import Path

from titanlite.errors import UserError

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


def _claim_once() -> bool:
    """True if this fault may fire: no TITANLITE_FAULT_ONCE file, or we are the first to create it."""
    path = os.environ.get(PREFIX + "ONCE")
    if not path:
        return True
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def before_step(step: int, rank: int) -> None:
    """The rank faults of step `step` (EXIT_AT, SIGTERM_AT, USER_ERROR_AT, CRASH_AT, HANG_AT), on the faulting
    rank."""
    if rank != int(os.environ.get(PREFIX + "RANK", "0")):
        return
    if step == _step("EXIT_AT") and _claim_once():
        logger.error(f"fault injection: rank {rank} exits abruptly at step {step}")
        os._exit(17)
    if step == _step("SIGTERM_AT") and _claim_once():
        os.kill(os.getpid(), signal.SIGTERM)
    if step == _step("USER_ERROR_AT") and _claim_once():
        raise UserError(f"fault injection: rank {rank} found bad input at step {step}")
    if step == _step("CRASH_AT") and _claim_once():
        raise RuntimeError(f"fault injection: rank {rank} crashed at step {step}")
    if step == _step("HANG_AT") and _claim_once():
        logger.error(f"fault injection: rank {rank} hangs at step {step}")
        while True:
            time.sleep(1)


def nan_loss_at(step: int) -> bool:
    """Whether step `step`'s loss is to be made NaN (NAN_AT)."""
    value = os.environ.get(NAN_AT)
    return bool(value) and str(step) in value.split(",")


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
