"""User-facing errors and the one mapping from errors to exit codes, shared by every command-line tool.

A `UserError` is bad input (config, data paths, checkpoints) rather than a bug: the tool prints its
message as one line and exits with code 2, without a traceback. `TrainingDiverged` exits with 3,
`RunNotSaved` (a run that ended or stopped without saving what it trained) with 4. A stop signal
(SIGINT, SIGTERM, SIGUSR1) while a tool runs is one line and exit code 128 + the signal (`run_tool`).
Anything else is a bug or an environment failure: its traceback is printed and the exit code is 1.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from collections.abc import Callable

EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3
EXIT_NOT_SAVED = 4
EXIT_HUNG = 5
"""The launcher's: ranks hung (`launcher/hang_watchdog.py`) and no restart was left."""


class UserError(Exception):
    """Bad input that the user can fix; reported in one line, exit code 2."""

    def __str__(self) -> str:
        """The message. One raised in a data loader worker reaches the training loop re-created by torch, with
        the worker's traceback as its message (`Caught DataError in DataLoader worker process 0.` /
        `Original Traceback ...` / `titanlite.errors.DataError: <message>`): its own is the last line's."""
        text = super().__str__()
        if text.startswith("Caught ") and "\nOriginal Traceback" in text:
            last = text.rstrip().splitlines()[-1]
            return last.split(": ", 1)[-1]
        return text


class ConfigError(UserError):
    """A config file or command-line override is invalid."""


class DataError(UserError):
    """The dataset cannot be read (no files match, nothing usable)."""


class CheckpointError(UserError):
    """A checkpoint is missing, incomplete or incompatible."""


class DumpFolderInUse(UserError):
    """Another run holds the dump folder's lock (`titanlite/checkpoint/lock.py`)."""


class TrainingDiverged(UserError):
    """The loss or gradient norm stopped being finite; reported in one line, exit code 3."""


class RunNotSaved(CheckpointError):
    """The run ended (its last step, a stop signal, `checkpoint.stop_on_save_error`) but what it trained
    since the last good checkpoint could not be saved, or was not (checkpointing off): one line naming the
    last good checkpoint, exit code 4, so a scheduler never reads the lost work as success."""


def exit_code(error: UserError) -> int:
    if isinstance(error, TrainingDiverged):
        return EXIT_DIVERGED
    return EXIT_NOT_SAVED if isinstance(error, RunNotSaved) else EXIT_USER_ERROR


STOPPED_WORDS = "TITANLITE_STOPPED"
"""The environment variable holding what a tool's stop line says after the signal's name (run_train.sh sets
it for the tools it runs: `before any rank started: nothing was trained`)."""
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class Stopped(BaseException):
    """A stop signal arrived while a tool ran (`run_tool`); a BaseException, so no `except Exception` in the
    tool swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop(signum: int, frame: object) -> None:
    raise Stopped(signum)


def run_cli(main: Callable[[list[str]], int], argv: list[str] | None = None) -> int:
    """Run a command's `main(argv)`: a `UserError` becomes one line on stderr and its exit code. The launcher,
    the ranks and the set-up's checks run so: their stop signals are their own (`run/signals.py`)."""
    try:
        return main(list(sys.argv[1:] if argv is None else argv))
    except UserError as e:
        print(f"titanlite: error: {e}", file=sys.stderr, flush=True)
        return exit_code(e)


def run_tool(main: Callable[[list[str]], int], argv: list[str] | None = None) -> int:
    """Run a tool's `main(argv)` as `run_cli` does, and end it on a stop signal (one not ignored when the
    process started) with one line and 128 + the signal. The stop signals are unblocked once their handlers
    exist: run_train.sh starts the dry run and the layout search with them blocked, so one sent while the
    tool imports waits for its handler instead of killing it or raising inside an import."""
    main_thread = threading.current_thread() is threading.main_thread()  # where handlers can be installed
    stops = [sig for sig in _STOP_SIGNALS if main_thread and signal.getsignal(sig) not in (signal.SIG_IGN, None)]
    previous = {sig: signal.getsignal(sig) for sig in stops}
    try:
        for sig in stops:
            signal.signal(sig, _stop)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        return run_cli(main, argv)
    except Stopped as e:
        words = os.environ.get(STOPPED_WORDS) or "received: the command stopped before it finished"
        print(f"titanlite: {signal.Signals(e.signum).name} {words}", file=sys.stderr, flush=True)
        return 128 + e.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def exit_now(code: int) -> None:
    """End a process that has imported torch, once its work is written: stop and wait for its other
    threads as the interpreter's exit does, run the `atexit` functions (logging, W&B, torch's own), flush stdout and
    stderr, and exit with `code` without the interpreter's teardown of torch's modules and C++ objects.
    That teardown takes 0.5-1 s per process, and torch 2.13's gloo backend now and then aborts in it
    ("terminate called without an active exception" from a C++ destructor: a script that only shards a
    tensor and takes its norm aborted in 3 of 4 launches of 4 ranks), which would turn a finished rank's
    exit code into -6 and its launcher's into a failure."""
    # The interpreter's own first step of exiting: the threading exit hooks (a thread pool's idle workers
    # are told to stop), then every non-daemon thread joined.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a pipe whose reader is gone: nothing more to write
            pass
    os._exit(code)
