"""How a rank ends under its launcher: it dies with the launcher, and reports its failure once.

Under the launcher (`titanlite.launcher.launch`, which sets `LAUNCHER_PID_ENV`) a rank dies with the launcher
(Linux parent-death signal) and reports its failure into the error file torch elastic gives it
(`TORCHELASTIC_ERROR_FILE`) instead of its own stderr, so the launcher prints the root cause once. Alone
or under torchrun, the same `run_rank` keeps `errors.run_cli`'s contract.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable

from titanlite.errors import UserError, exit_code, run_cli

logger = logging.getLogger("titanlite")

LAUNCHER_PID_ENV = "TITANLITE_LAUNCHER_PID"
"""Set by `titanlite.launcher.launch` for its ranks: the launcher's pid."""

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_FAILED_AT = "_titanlite_failed_at"  # attribute note_failure sets on the exception


def follow_launcher() -> None:
    """Under the launcher, have Linux kill this rank when the launcher dies (even by SIGKILL), so no rank
    trains on orphaned. A save in progress is cut short: its `step-N.partial` folder is never loaded."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if not launcher or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        logger.warning(f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}")
    # The launcher may have died before the request: then we are already someone else's child.
    if os.getppid() != int(launcher):
        os._exit(1)


def note_failure(error: BaseException) -> None:
    """Stamp `error` with the time training failed, before cleanup (closing the process group, exiting)
    lets the peers fail too: the launcher reports the earliest failure as the root cause."""
    if not hasattr(error, _FAILED_AT):
        setattr(error, _FAILED_AT, time.time())


def write_failure(path: str, message: str, code: int, error: BaseException) -> None:
    """Record why this rank fails in torch elastic's error-file format (a string message), with the exit
    code and a precise time so the launcher can tell the first failure from its consequences."""
    when = getattr(error, _FAILED_AT, time.time())
    with open(path, "w") as f:
        json.dump({"message": message, "timestamp": int(when), "time": when, "exit_code": code}, f)


def run_rank(main: Callable[[list[str]], int], argv: list[str] | None = None) -> int:
    """Run the trainer's `main` as a command: `errors.run_cli`'s contract (a `UserError` is one line and
    exit code 2 or 3) plus exit code 130 without a traceback on Ctrl-C twice. Under the launcher the
    rank follows it, and the error line or traceback goes to the rank's error file for the launcher to
    print once, not to this rank's own output (which the launcher may show too)."""
    follow_launcher()
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE") if os.environ.get(LAUNCHER_PID_ENV) else None
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if error_file is None:
            return run_cli(main, argv)
        try:
            return main(argv)
        except UserError as e:
            write_failure(error_file, f"titanlite: error: {e}", exit_code(e), e)
            return exit_code(e)
        except Exception as e:
            write_failure(error_file, traceback.format_exc(), 1, e)
            return 1
    except KeyboardInterrupt:
        print("titanlite: interrupted", file=sys.stderr, flush=True)
        return 130
