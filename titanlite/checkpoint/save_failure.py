"""A failed checkpoint save in one line: which rank failed and why, with the cause behind the message.

torch's file writer reports a full disk or a file that hit the process's file size limit (`ulimit -f`,
`RLIMIT_FSIZE`: Python ignores SIGXFSZ, so the write just stops short) as a short write, e.g.
`RuntimeError: [enforce fail at inline_container.cc] . unexpected pos 704 vs 598`, which names neither.
The line names the cause first: `the disk under <folder> is full (N MiB free; <torch's error>)` when the
error is ENOSPC or, with no file size limit to explain it, the folder's file system has (almost) no
space left while the failed save's files still fill it; else torch's error with what may explain it
(a finite file size limit, the free space).
"""

from __future__ import annotations

import errno
import resource
import shutil
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException


def describe_error(error: BaseException) -> str:
    """A save error in one line; DCP's CheckpointException holds the exception of every failed rank."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (cause, _) = min(error.failures.items())
        text = f"{type(cause).__name__} on rank {rank}: {cause}"
    else:
        text = f"{type(error).__name__}: {error}"
    return " ".join(text.split())


def file_size_limit() -> int | None:
    """This process's file size limit in bytes (`ulimit -f`), or None when there is none."""
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


FULL_BELOW = 64 << 20
"""Free bytes below which a failed save's file system counts as full (or 1% of its size, if more)."""


def _errnos(error: BaseException) -> set[int]:
    """The errno of every OSError in `error`, its causes and (DCP) every failed rank's exception."""
    found: set[int] = set()
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            found.add(e.errno)
        if isinstance(e, CheckpointException):
            todo += [cause for cause, _ in e.failures.values()]
        todo += [e.__cause__, e.__context__]
    return found


def save_failure(step: int, path: Path, error: BaseException) -> str:
    """`checkpoint step N could not be saved to PATH: <cause> (<details>)` (module docstring)."""
    torch_error = describe_error(error)
    message = f"checkpoint step {step} could not be saved to {path}: "
    limit = file_size_limit()
    try:
        disk = shutil.disk_usage(path.parent)
    except OSError:
        disk = None
    if disk is not None and (
        errno.ENOSPC in _errnos(error) or (limit is None and disk.free < max(FULL_BELOW, disk.total // 100))
    ):
        return message + f"the disk under {path.parent} is full ({disk.free / 2**20:,.0f} MiB free; {torch_error})"
    causes = []
    if limit is not None:
        causes.append(f"the file size limit (ulimit -f) is {limit / 2**20:,.4g} MiB: no file may grow past it")
    if disk is not None:
        causes.append(f"{disk.free / 2**20:,.0f} MiB free on its file system")
    return message + torch_error + (f" ({'; '.join(causes)})" if causes else "")
