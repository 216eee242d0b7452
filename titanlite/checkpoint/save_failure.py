"""A failed checkpoint save in one line: which rank failed and why, with the cause behind the message.

torch's file writer reports a full disk or a file that hit the process's file size limit (`ulimit -f`,
`RLIMIT_FSIZE`: Python ignores SIGXFSZ, so the write just stops short) as a short write, e.g.
`RuntimeError: [enforce fail at inline_container.cc] . unexpected pos 704 vs 598`; the line adds what
explains it: the free space on the folder's file system and a finite file size limit.
"""

from __future__ import annotations

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


def save_failure(step: int, path: Path, error: BaseException) -> str:
    """`checkpoint step N could not be saved to PATH: <error> (<causes>)`."""
    message = f"checkpoint step {step} could not be saved to {path}: {describe_error(error)}"
    causes = []
    if (limit := file_size_limit()) is not None:
        causes.append(f"the file size limit (ulimit -f) is {limit / 2**20:,.4g} MiB: no file may grow past it")
    try:
        causes.append(f"{shutil.disk_usage(path.parent).free / 2**20:,.0f} MiB free on its file system")
    except OSError:
        pass
    return message + (f" ({'; '.join(causes)})" if causes else "")
