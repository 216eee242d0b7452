"""The document index of a local data file, scanned once and kept next to the run.

Scanning a file into document byte offsets (`file_scan.py`) reads every byte, the slow part of starting on
a large dataset, and every process of a launch needs the same index. So the first process to scan a
file stores its `FileIndex` in `index_dir` (`<job.dump_folder>/data_index/`), holding an `fcntl.flock`
beside the entry while the others wait, and later processes load it while the file's size and
modification time are unchanged. A loaded index memory-maps its offsets and lengths (`Spans`), so a
node's processes share one copy. The scan hashes every byte it reads, giving each file the content
digest the dataset fingerprint is made of. Stored format, one file per data file: a JSON header line,
then the offsets and lengths as native int64 arrays. Why and when: docs/configuration.md#data.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

VERSION = 1


class Spans:
    """One file's documents: row 0 of `table()` their byte offsets in the (decompressed) file, row 1 their
    byte lengths (parquet: row numbers). Loaded ones are mapped from the stored index at each `table()` (the
    caller keeps the few it reads) and pickle as where they are; a scan's own are held in memory."""

    def __init__(self, count: int, held: np.ndarray | None = None, stored: tuple[Path, int] | None = None) -> None:
        self.count = count
        self._held = held
        self._stored = stored  # (index file, byte offset of the arrays)

    @classmethod
    def of(cls, spans: list[tuple[int, int]]) -> Spans:
        flat = np.fromiter(itertools.chain.from_iterable(spans), dtype=np.int64, count=2 * len(spans))
        return cls(len(spans), held=flat.reshape(-1, 2).T.copy())

    def __len__(self) -> int:
        return self.count

    def table(self) -> np.ndarray:
        """The (2, count) int64 table: offsets, lengths."""
        if self._stored is None or not self.count:
            return self._held if self._held is not None else np.zeros((2, 0), dtype=np.int64)
        path, start = self._stored
        return np.memmap(path, dtype=np.int64, mode="r", offset=start, shape=(2, self.count))


@dataclass
class FileIndex:
    """One file's documents and what its scan found."""

    size: int
    mtime_ns: int
    digest: str = ""
    """BLAKE2b of the bytes the scan read (the file's whole content)."""
    spans: Spans = field(default_factory=lambda: Spans(0))
    notes: list[str] = field(default_factory=list)
    """What the scan reported (skipped records, an unreadable tail), printed as warnings by the process
    that reports on the data."""


def content_hash() -> hashlib.blake2b:
    return hashlib.blake2b(digest_size=16)


def entry(index_dir: str, path: Path, key: str, suffix: str = ".idx") -> Path:
    """Where `index_dir` keeps what it records of `path` (under `key`: its kind and text field)."""
    name = hashlib.blake2b(f"{path.resolve()}\0{key}".encode(), digest_size=12).hexdigest()
    return Path(index_dir) / f"{name}{suffix}"


@contextlib.contextmanager
def building(path: Path) -> Iterator[None]:
    """Held while this process makes the entry at `path`: the others wait (module docstring)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        fd = None
    try:
        if fd is not None:
            with contextlib.suppress(OSError):  # no flock on this file system: unlocked
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def load(index_dir: str | None, path: Path, key: str) -> FileIndex | None:
    """The stored index of `path` (scanned with `key`: its kind and text field), if the file is unchanged."""
    if not index_dir:
        return None
    stored = entry(index_dir, path, key)
    try:
        stat = path.stat()
        with open(stored, "rb") as f:
            header = json.loads(f.readline())
            if (header["version"], header["size"], header["mtime_ns"]) != (VERSION, stat.st_size, stat.st_mtime_ns):
                return None
            n, start = header["documents"], f.tell()
            if os.fstat(f.fileno()).st_size != start + 16 * n:  # cut short (a full disk)
                return None
    except (OSError, ValueError, KeyError):
        return None
    spans = Spans(n, stored=(stored, start))
    return FileIndex(stat.st_size, stat.st_mtime_ns, header["digest"], spans, header["notes"])


def store(index_dir: str | None, path: Path, key: str, index: FileIndex) -> None:
    """Keep `index` for the next process (best effort: an unwritable or full folder only costs a scan)."""
    if not index_dir:
        return
    stored = entry(index_dir, path, key)
    tmp = stored.with_name(f"{stored.name}.{os.getpid()}.tmp")
    header = {
        "version": VERSION,
        "path": str(path),
        "size": index.size,
        "mtime_ns": index.mtime_ns,
        "digest": index.digest,
        "documents": len(index.spans),
        "notes": index.notes,
    }
    try:
        stored.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(json.dumps(header).encode() + b"\n")
            index.spans.table().tofile(f)
        os.replace(tmp, stored)
    except OSError:
        tmp.unlink(missing_ok=True)


def indexed(index_dir: str | None, path: Path, key: str, scan: Callable[[], FileIndex]) -> FileIndex:
    """`path`'s index: the stored one while the file is unchanged, else `scan()`'s, stored by the one process
    that scans while the others wait (module docstring), and then read back mapped."""
    found = load(index_dir, path, key)
    if found is not None or not index_dir:
        return found or scan()
    with building(entry(index_dir, path, key)):
        found = load(index_dir, path, key)  # stored while this process waited
        if found is None:
            scanned = scan()
            store(index_dir, path, key, scanned)
            found = load(index_dir, path, key) or scanned
    return found
