"""The dump-folder lock: one run at a time writes checkpoints and metrics into a dump folder.

Two runs on one folder would delete each other's saves and interleave their metrics, so rank 0 holds
`fcntl.flock` on `<dump_folder>/.lock` for the life of the run, with its host and pid written in for the
refusal (`DumpFolderInUse`, one line, exit code 2), and with checkpointing a flock on the checkpoint folder
itself, which may lie outside the dump folder. The kernel releases a flock however its holder dies, so there
is no stale state; forked children close their copy at once. The lock is per process and shared by every
trainer in it; on a file system without flock the run goes on with a warning.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time
from pathlib import Path

from titanlite.errors import DumpFolderInUse

logger = logging.getLogger("titanlite")

LOCK_NAME = ".lock"
DUMP_FOLDER = "job.dump_folder"
"""The key of the folder locked through a `.lock` file in it (which records the holder); a folder of any
other key (`checkpoint.folder`) is locked itself."""

# Locks held by this process: lock file -> (its descriptor, number of holders in this process).
_held: dict[Path, tuple[int, int]] = {}


def _close_in_child() -> None:
    """After a fork: the child must not keep the parent's locks alive (module docstring)."""
    for fd, _ in _held.values():
        os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


def _path(folder: str, key: str = DUMP_FOLDER) -> Path:
    """What is locked: the dump folder's `.lock` file (it records the holder), or the folder `key` names
    itself (module docstring)."""
    return (Path(folder) / LOCK_NAME).resolve() if key == DUMP_FOLDER else Path(folder).resolve()


def _folder(path: Path, key: str) -> Path:
    """The folder whose lock `path` is (`_path`'s inverse)."""
    return path.parent if key == DUMP_FOLDER else path


def _holder(fd: int) -> str:
    """The holder recorded in the lock file, as `DumpFolderLock` writes it."""
    try:
        text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "holder unknown"


def run_folders(dump_folder: str, checkpoint_folder: str | None) -> dict[str, str]:
    """The folders a run locks, by the config key naming each: the dump folder, and the checkpoint folder
    (`checkpoint_folder`, relative to the dump folder; None with checkpointing off)."""
    out = {DUMP_FOLDER: dump_folder}
    if checkpoint_folder is not None:
        out["checkpoint.folder"] = str((Path(dump_folder) / checkpoint_folder).resolve())
    return out


def _try_lock(path: Path, key: str) -> int | None:
    """An open descriptor of `path` (a lock file, or a folder) holding its flock, or None on a file system
    without flock."""
    folder = key != DUMP_FOLDER
    fd = os.open(path, os.O_RDONLY) if folder else os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            holder = "" if folder else f" ({_holder(fd)})"
            os.close(fd)
            raise DumpFolderInUse(
                f"{key} {_folder(path, key)} is in use by another run{holder}: wait for it to end "
                f"or choose another {key}"
            ) from None
        os.close(fd)
        logger.warning(f"cannot lock {path} ({e.strerror}): a second run on this {key} would not be detected")
        return None
    return fd


class DumpFolderLock:
    """Holds the lock of one dump folder (or of the folder `key` names) until `release()` (or the process
    ends)."""

    def __init__(self, dump_folder: str, key: str = DUMP_FOLDER):
        self.path = _path(dump_folder, key)
        self._released = False
        if self.path in _held:
            fd, count = _held[self.path]
            _held[self.path] = (fd, count + 1)
            return
        if key == DUMP_FOLDER:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = _try_lock(self.path, key)
        else:
            try:
                self.path.mkdir(parents=True, exist_ok=True)
                fd = _try_lock(self.path, key)
            except OSError:  # no folder to hold checkpoints: the saves report that (stop_on_save_error)
                fd = None
        if fd is None:
            self._released = True
            return
        _held[self.path] = (fd, 1)
        if key != DUMP_FOLDER:
            return  # a folder records no holder
        os.ftruncate(fd, 0)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
        try:  # who holds it, for the message a second run gets; the lock itself needs no space
            os.pwrite(fd, f"host {socket.gethostname()}, pid {os.getpid()}, since {stamp}\n".encode(), 0)
        except OSError:
            pass

    def release(self) -> None:
        """Drop this holder; the flock is released when the last holder in the process lets go."""
        if self._released:
            return
        self._released = True
        fd, count = _held[self.path]
        if count > 1:
            _held[self.path] = (fd, count - 1)
            return
        del _held[self.path]
        os.close(fd)  # closing the descriptor releases the flock; the file stays for the next run


def check_free(dump_folder: str, key: str = DUMP_FOLDER) -> None:
    """Raise `DumpFolderInUse` if another process holds the folder's lock (the preflight's check)."""
    path = _path(dump_folder, key)
    if path in _held or not _folder(path, key).is_dir():
        return
    fd = _try_lock(path, key)
    if fd is not None:
        os.close(fd)
