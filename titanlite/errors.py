"""User-facing errors and the one mapping from errors to exit codes, shared by every command-line tool.

A `UserError` is bad input (config, data paths, checkpoints) rather than a bug: the tool prints its
message as one line and exits with code 2, without a traceback. `TrainingDiverged` exits with 3.
Anything else is a bug or an environment failure: its traceback is printed and the exit code is 1.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3


class UserError(Exception):
    """Bad input that the user can fix; reported in one line, exit code 2."""


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


def exit_code(error: UserError) -> int:
    return EXIT_DIVERGED if isinstance(error, TrainingDiverged) else EXIT_USER_ERROR


def run_cli(main: Callable[[list[str]], int], argv: list[str] | None = None) -> int:
    """Run a tool's `main(argv)`: a `UserError` becomes one line on stderr and its exit code."""
    try:
        return main(list(sys.argv[1:] if argv is None else argv))
    except UserError as e:
        print(f"titanlite: error: {e}", file=sys.stderr, flush=True)
        return exit_code(e)
