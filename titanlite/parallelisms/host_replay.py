"""Host values a forward read from the device, handed back to activation checkpointing's recompute.

Some forwards must read a few device values on the host (expert parallelism's all-to-all row splits):
each read waits for the device (a host sync). A fully checkpointed block runs its forward twice, the
second time in backward to recompute its activations, and would read the same values again. A
`HostReplay` records what the first forward read and returns it to the recompute instead: the recompute
reads nothing.

Scope: one record per checkpoint call. `checkpoint_contexts` gives the pair of context managers that
`torch.utils.checkpoint`'s `context_fn` takes (the first around the forward, the second around the
recompute), sharing a fresh record; outside a checkpoint every read is a plain read. The recompute of a
call replays that call's record, whatever the order in which the schedule runs the backwards (pipeline
microbatches, accumulation).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class HostReplay:
    """Recorded host reads of the checkpoint call being run or recomputed (module docstring)."""

    def __init__(self) -> None:
        self._record: list[Any] | None = None
        """The running checkpoint call's reads (None: no checkpoint call is running)."""
        self._replaying = False
        self._cursor = 0

    def read(self, fn: Callable[[], T]) -> T:
        """`fn()` (a host read of device values), recorded inside a checkpointed forward; in its recompute,
        the value the forward read, in the same order."""
        if self._record is None:
            return fn()
        if not self._replaying:
            value = fn()
            self._record.append(value)
            return value
        assert self._cursor < len(self._record), "a recompute read more host values than its forward"
        value = self._record[self._cursor]
        self._cursor += 1
        return value

    def checkpoint_contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """(around the forward: record, around the recompute: replay) for one checkpoint call."""
        record: list[Any] = []
        return self._use(record, replaying=False), self._use(record, replaying=True)

    @contextlib.contextmanager
    def _use(self, record: list[Any], replaying: bool) -> Iterator[None]:
        saved = self._record, self._replaying, self._cursor
        self._record, self._replaying, self._cursor = record, replaying, 0
        try:
            yield
        finally:
            self._record, self._replaying, self._cursor = saved
