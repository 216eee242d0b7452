"""The bound on the files a data source keeps open: the least recently used one is closed past `OPEN_FILES`.

A process reads many files in turn: a local dataset's files, a tokenized folder's shards (about 90,000 for a
1T-token corpus at 16,384 documents a shard), each virtual shard stream striding over all of them. Every file
kept open holds a descriptor (a memory map holds one too) under `ulimit -n`, often 1,024, and a map counts
against `vm.max_map_count`: keeping each file once read open ends in EMFILE. The streams of a process read
documents of a few files at a time, so the few most recently used stay open.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

OPEN_FILES = 8

T = TypeVar("T")


class OpenFiles(Generic[T]):
    """Up to `capacity` open files (or what was read from them) by file number; `close` ends an evicted one."""

    def __init__(self, close: Callable[[T], None], capacity: int = OPEN_FILES) -> None:
        self.capacity = capacity
        self._close = close
        self._open: OrderedDict[int, T] = OrderedDict()

    def get(self, key: int, open_file: Callable[[int], T]) -> T:
        """File `key`: as open, or `open_file(key)`, closing the least recently used one past the capacity."""
        if key in self._open:
            self._open.move_to_end(key)
            return self._open[key]
        opened = self._open[key] = open_file(key)
        if len(self._open) > self.capacity:
            _, old = self._open.popitem(last=False)
            self._close(old)
        return opened

    def __len__(self) -> int:
        return len(self._open)

    def __getstate__(self) -> dict:
        """Picklable for spawned dataloader workers: a process opens its own files."""
        return {**self.__dict__, "_open": OrderedDict()}
