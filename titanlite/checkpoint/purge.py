"""Deleting retired checkpoint folders on a background thread of rank 0 (`folders.py` retires them).

Deleting a large checkpoint takes minutes on a shared file system while the other ranks wait in the next
step's collectives, so the training thread only renames a folder out of the way (`folders.retire`, after which
nothing sees it as a checkpoint) and this thread deletes it. Bounded: pruning hands over a checkpoint only
while fewer than `PRUNE_BACKLOG` are queued (`room`), else it stays a complete `step-N` and is pruned at a later
save; folders that must move out of a save's way are retired whatever the backlog. Joined: `finish` waits for
every deletion at the end of the run (a failure is one warning), except on a stop signal, which leaves the
folders retired for the next run's purge (`folders.retired`). The behaviour: docs/checkpoints.md.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from titanlite import faults
from titanlite.checkpoint import folders

logger = logging.getLogger("titanlite")

PRUNE_BACKLOG = 1
"""Pruned checkpoints queued or being deleted at most: one deletion in flight, as one save is."""
STOP_POLL_SECONDS = 0.2
"""How often `finish` looks for a stop signal while it waits for deletions."""
Stopping = Callable[[], bool]
"""Whether a stop signal ends the run (asked while `finish` waits)."""


def never() -> bool:
    return False


class Purger:
    """One background thread deleting the retired folders handed to it, in order (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._queue: list[Path] = []
        self._pruned: set[Path] = set()  # the queued or in-flight folders that pruning handed over
        self._busy: Path | None = None
        self._failed: list[str] = []
        self._left: set[Path] = set()  # the folders a stop signal left to the next run, as reported
        self._thread: threading.Thread | None = None

    def room(self) -> int:
        """How many more pruned checkpoints may be handed over now (`PRUNE_BACKLOG`)."""
        with self._lock:
            return max(0, PRUNE_BACKLOG - len(self._pruned))

    def submit(self, path: Path, pruned: bool = False) -> None:
        """Delete the retired folder `path` in the background; `pruned`: it counts against the backlog."""
        with self._lock:
            self._queue.append(path)
            if pruned:
                self._pruned.add(path)
            if self._thread is None:
                # A daemon: a crash does not wait for deletions (what it leaves is retired, see above).
                self._thread = threading.Thread(target=self._run, name="titanlite-purge", daemon=True)
                self._thread.start()
            self._lock.notify_all()

    def pending(self) -> list[Path]:
        """The folders handed over and not yet deleted, the one being deleted first."""
        with self._lock:
            return ([self._busy] if self._busy else []) + list(self._queue)

    def prune(self, root: Path, keep: int, saved: int) -> str:
        """Retire and hand over the checkpoints in `root` beyond the newest `keep` up to step `saved` (the
        one just saved, which is never pruned: `folders.prune`), as many as there is `room` for; what was
        done, as the end of the save's log line."""
        pruned, held = folders.prune(root, keep, self._submit_pruned, self.room(), saved)
        text = f"; deleting {', '.join(p.name for p in pruned)} in the background" if pruned else ""
        if held:
            text += (
                f"; {', '.join(p.name for p in held)} kept until the deletion in progress ends"
                " (deleting is slower than checkpoint.interval)"
            )
        return text

    def finish(self, root: Path, keep: int, saved: int | None, stopping: Stopping = never) -> None:
        """The end of the run: retire what pruning left for later (up to step `saved`, the run's last
        save; None: the run saved nothing) and wait until every folder handed over is deleted, so none
        is silently dropped; a failed deletion is one warning naming the folder. On a stop signal
        (`stopping`, before or during the wait) the rest is left to the next run (module docstring)."""
        start = time.perf_counter()
        try:
            folders.prune(root, keep, self._submit_pruned, saved=saved)
        except OSError as e:
            logger.warning(f"checkpoint: could not retire old checkpoints in {root}: {e}")
        if (waiting := self.pending()) and not stopping():
            logger.info(f"checkpoint: waiting for the deletion of {', '.join(p.name for p in waiting)}")
        failures = self.join(stopping)
        for failure in failures or ():
            logger.warning(f"checkpoint: {failure}; delete it by hand")
        if failures is None:
            if left := [p for p in self.pending() if p not in self._left]:  # said once (close runs twice)
                self._left.update(left)
                names = ", ".join(p.name for p in left)
                logger.info(f"checkpoint: stop signal: {names} left retired, not deleted; the next run deletes them")
        elif waiting:
            logger.info(f"checkpoint: old checkpoints deleted ({time.perf_counter() - start:.2f}s waited)")

    def _submit_pruned(self, path: Path) -> None:
        self.submit(path, pruned=True)

    def join(self, stopping: Stopping = never) -> list[str] | None:
        """Wait until every folder handed over is deleted; the failures since the last join, one line each,
        or None when a stop signal (`stopping`) ended the wait first."""
        with self._lock:
            while self._queue or self._busy is not None:
                if stopping():
                    return None
                self._lock.wait(STOP_POLL_SECONDS)
            failed, self._failed = self._failed, []
        return failed

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue:
                    self._lock.wait()
                path = self._busy = self._queue.pop(0)
            error = _delete(path)
            with self._lock:
                if error:
                    self._failed.append(error)
                self._pruned.discard(path)
                self._busy = None
                self._lock.notify_all()


def _delete(path: Path) -> str | None:
    """Delete `path`; why not, in one line, or None."""
    start = time.perf_counter()
    faults.slow_purge(path)
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        return f"could not delete {path}: {e.strerror or e} ({e.filename})"
    logger.debug(f"checkpoint: deleted {path} in {time.perf_counter() - start:.2f}s")
    return None
