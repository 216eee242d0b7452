"""LocalSource: local files as one document source, read by document number from their index.

A `LocalSource` numbers the documents of its files (sorted by path, `local_files.py`) in one global
order, from an index of each file built once (`file_scan.py`, cached by `index.py`): document d is
(file, byte offset, byte length), so a shard stream seeks straight to its documents, at start, on
resume or at an epoch. Plain files are mapped, compressed ones decompressed forward (`file_streams.py`),
and only the last few files stay open (`open_files.py`). A held-out tail for validation is a `part` of
the source sharing its index.
"""

from __future__ import annotations

import bisect
import copy
import json
import logging
import mmap
from array import array
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from titanlite.data import file_scan, file_streams, index
from titanlite.data.local_files import file_format
from titanlite.data.open_files import OpenFiles

logger = logging.getLogger("titanlite")


def _close_map(data: mmap.mmap | bytes | list[str | None]) -> None:
    """Close what `LocalSource._read` made, if it is a map."""
    if isinstance(data, mmap.mmap):
        data.close()


def _drop(table: np.ndarray) -> None:
    """A file's spans (`index.Spans.table`) are unmapped when the last reference to them goes."""


class LocalSource:
    """Local files, indexed once (`index.py`): document d -> (file, byte offset, byte length).

    `index_dir` keeps the files' indexes for the other processes of a launch and for later launches, and
    their documents' offsets are read mapped from it (shared, never pickled into a worker: `index.Spans`);
    `report` prints what the scans found (skipped records, unreadable tails) as warnings: the launcher's
    preflight reports, the ranks it starts do not repeat it."""

    def __init__(
        self, files: list[Path], text_field: str, name: str, index_dir: str | None = None, report: bool = True
    ) -> None:
        self.name = name
        self.files = files
        self.text_field = text_field
        self.formats = [file_format(f) or ("txt", "") for f in files]  # resolve_files kept supported ones
        self._starts = array("q")  # index of each file's first document
        self._spans: list[index.Spans] = []  # each file's documents: byte offset and length; parquet: row
        self._tables: OpenFiles[np.ndarray] = OpenFiles(_drop)  # the last few files' spans, mapped
        self.digests: list[str] = []
        """Each file's content digest (`index.FileIndex.digest`), in file order."""
        self._cache: OpenFiles[mmap.mmap | bytes | list[str | None]] = OpenFiles(_close_map)
        if any(kind == "parquet" for kind, _ in self.formats):
            file_streams.require_pyarrow()
        if any(compression == "zst" for _, compression in self.formats):
            file_streams.require_zstandard()
        documents = 0
        for i, path in enumerate(files):
            key = f"{self.formats[i][0]}:{self.formats[i][1]}:{text_field}"
            found = index.indexed(index_dir, path, key, lambda i=i, path=path: self._index(i, path))
            if report:
                for note in found.notes:
                    logger.warning(note)
            self._starts.append(documents)
            self._spans.append(found.spans)
            self.digests.append(found.digest)
            documents += len(found.spans)
        self.num_documents: int = documents
        self._first = 0  # global index of this source's document 0 (`part`)

    def part(self, begin: int, end: int) -> LocalSource:
        """Documents [begin, end) as a source of their own, numbered from 0, sharing this one's index and open
        files (a held-out tail for validation: the rest keeps its document numbers, hence its virtual shards)."""
        if not 0 <= begin <= end <= self.num_documents:
            raise ValueError(f"documents [{begin}, {end}) of {self.num_documents}")
        part = copy.copy(self)
        part._first, part.num_documents = self._first + begin, end - begin
        return part

    def _index(self, i: int, path: Path) -> index.FileIndex:
        """Scan one file (`file_scan.scan_file`)."""
        return file_scan.scan_file(path, *self.formats[i], self.text_field)

    def _load(self, i: int) -> mmap.mmap | bytes | list[str | None]:
        """A plain file mapped, or a parquet text column, kept among the few last used (`open_files.py`):
        shard streams read documents of the same few files."""
        return self._cache.get(i, self._read)

    def _read(self, i: int) -> mmap.mmap | bytes | list[str | None]:
        path = self.files[i]
        if self.formats[i][0] == "parquet":
            return file_streams.read_parquet_column(path, self.text_field)
        if path.stat().st_size == 0:
            return b""
        with open(path, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def _span(self, i: int, j: int) -> tuple[int, int]:
        """(offset, length) of document j of file i, from the file's spans, kept mapped while among the last
        files read (`open_files.py`)."""
        table = self._tables.get(i, lambda k: self._spans[k].table())
        return int(table[0, j]), int(table[1, j])

    def document(self, d: int, readers: dict[int, file_streams.ForwardReader] | None = None) -> str:
        """Document `d`. A compressed file is read through `readers[file]` (kept by the caller, so that
        reading forward resumes where it stopped), or decompressed from its start without one."""
        i = bisect.bisect_right(self._starts, d) - 1  # empty files share their successor's start
        kind, compression = self.formats[i]
        offset, length = self._span(i, d - self._starts[i])
        if kind == "parquet":
            return self._load(i)[offset]  # type: ignore[index,return-value]
        if compression:
            reader = (readers or {}).get(i) or file_streams.ForwardReader(self.files[i], compression)
            if readers is not None:
                readers[i] = reader
            raw = reader.read(offset, length)
            if readers is None:
                reader.close()
        else:
            raw = self._load(i)[offset : offset + length]  # type: ignore[index]
        if kind == "txt":
            return raw.decode("utf-8")
        return json.loads(raw)[self.text_field]

    def shard_documents(self, shard: int, num_shards: int, start: int, position: dict | None = None) -> Iterator[str]:
        return self.documents(range(shard + start * num_shards, self.num_documents, num_shards))

    def documents(self, ids: Iterable[int]) -> Iterator[str]:
        """Documents `ids` (increasing, numbered within this source) in order: each compressed file is
        decompressed forward once, one open at a time, instead of from its start for every document."""
        readers: dict[int, file_streams.ForwardReader] = {}
        try:
            for d in ids:
                d += self._first
                i = bisect.bisect_right(self._starts, d) - 1
                for other in [f for f in readers if f != i]:
                    readers.pop(other).close()
                yield self.document(d, readers)
        finally:
            for reader in readers.values():
                reader.close()
