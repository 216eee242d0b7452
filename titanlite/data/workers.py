"""How the data loader's worker processes start: from multiprocessing's fork server, never forked from the
process that iterates the loader.

A rank that iterates its loader holds its process group (on CUDA a CUDA context and NCCL communicators), which
a fork would carry into each worker. The fork server is a fresh interpreter the rank starts by exec, which
preloads the data package (`worker_context`) and forks the workers; CPU and CUDA start them alike, so the tested
path is the shipped one. A worker gets what crosses a pickle: the dataset (files reopened from its cursors) and
`WorkerSetup`, its `worker_init_fn`, which restores the `titanlite` logger's handlers and ends the worker
with the loader's process.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import select
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.context import BaseContext

WORKER_START = "forkserver"
"""The start method of the loader's worker processes (module docstring)."""
WORKER_PRELOAD = "titanlite.data.loader"
"""What the fork server imports before its first fork: torch, torchdata and the data package."""


def worker_context() -> BaseContext:
    """The multiprocessing context that starts the loader's workers: the fork server, preloaded with the
    data package. Each worker runs the main module as `__mp_main__`, as a spawned process does; the server
    does not import it first (a module already imported when runpy runs it again draws runpy's
    RuntimeWarning in the rank's log), and what it imports itself is light (the entry point's first lines).

    The preload is multiprocessing's setting for this process's one fork server, read when the server
    starts (the process's first worker start); the loader is its only user here."""
    context = multiprocessing.get_context(WORKER_START)
    context.set_forkserver_preload([WORKER_PRELOAD])
    return context


@dataclass(frozen=True)
class WorkerSetup:
    """A worker's `worker_init_fn`, made where the loader is built (`here`): the `titanlite` logger's level
    and its stdout/stderr handlers' formats (the worker's lines reach the same file descriptors), and the
    pid of the loader's process, whose end ends the worker."""

    loader_pid: int
    level: int
    handlers: tuple[tuple[str, logging.Formatter | None], ...]

    @classmethod
    def here(cls, log: logging.Logger) -> WorkerSetup:
        streams = {id(sys.stdout): "stdout", id(sys.stderr): "stderr"}
        handlers = tuple(
            (streams[id(h.stream)], h.formatter)
            for h in log.handlers
            if isinstance(h, logging.StreamHandler) and id(h.stream) in streams
        )
        return cls(os.getpid(), log.level, handlers)

    def __call__(self, worker_id: int) -> None:
        log = logging.getLogger("titanlite")
        log.setLevel(self.level)
        for stream, formatter in self.handlers:
            handler = logging.StreamHandler(getattr(sys, stream))
            handler.setFormatter(formatter)
            log.addHandler(handler)
        threading.Thread(target=_exit_with, args=(self.loader_pid,), name="loader-process", daemon=True).start()


def _exit_with(pid: int) -> None:
    """End this worker when process `pid` ends (its pidfd becomes readable; polled where there is none)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (not Linux 5.3+): poll
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(1.0)
    else:
        select.select([fd], [], [])
    os._exit(0)
