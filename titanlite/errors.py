"""User-facing errors.

A `UserError` is bad input (config, data paths, checkpoints) rather than a bug: the entry point prints
its message as one line and exits with code 2, without a traceback.
"""


class UserError(Exception):
    """Bad input that the user can fix; reported in one line, exit code 2."""


class ConfigError(UserError):
    """A config file or command-line override is invalid."""


class DataError(UserError):
    """The dataset cannot be read (no files match, nothing usable)."""


class CheckpointError(UserError):
    """A checkpoint is missing, incomplete or incompatible."""


class TrainingDiverged(UserError):
    """The loss or gradient norm stopped being finite; reported in one line, exit code 3."""
