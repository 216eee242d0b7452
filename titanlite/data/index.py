"""The document index of a local data file, scanned once and kept next to the run.

`LocalSource` scans every file at start-up into document byte offsets (row numbers for parquet), counting
bad records (`sources.py`). That scan reads every byte, which is the slow part of starting on a large
dataset, and every process of a launch needs the same index: the launcher's preflight, every rank, the
validation loader. So the first process to scan a file stores its `FileIndex` in `index_dir`
(`<job.dump_folder>/data_index/`); the others, and later launches, load it while the file's size and
modification time are unchanged. Without an `index_dir` (tools, tests) nothing is stored.

The scan hashes every byte it reads (BLAKE2b; the decompressed bytes of a compressed file, the raw bytes
of a parquet file), so each index carries a digest of its file's whole content at no extra read. The
dataset fingerprint a resume compares (`checkpoint/fingerprint.py`) is made of these digests: a change
anywhere in a file is seen, unless the file keeps both its size and its modification time (`touch -r`
after editing), which is not re-read.

Stored format, one file per data file (named by a hash of its absolute path, text field and kind): a
JSON header line, then the offsets and the lengths as native int64 arrays.
"""

from __future__ import annotations

import hashlib
import json
import os
from array import array
from dataclasses import dataclass, field
from pathlib import Path

VERSION = 1


@dataclass
class FileIndex:
    """One file's documents and what its scan found."""

    size: int
    mtime_ns: int
    digest: str = ""
    """BLAKE2b of the bytes the scan read (the file's whole content)."""
    offsets: array = field(default_factory=lambda: array("q"))
    lengths: array = field(default_factory=lambda: array("q"))
    notes: list[str] = field(default_factory=list)
    """What the scan reported (skipped records, an unreadable tail), printed as warnings by the process
    that reports on the data."""


def content_hash() -> hashlib.blake2b:
    return hashlib.blake2b(digest_size=16)


def _entry(index_dir: Path, path: Path, key: str) -> Path:
    name = hashlib.blake2b(f"{path.resolve()}\0{key}".encode(), digest_size=12).hexdigest()
    return index_dir / f"{name}.idx"


def load(index_dir: str | None, path: Path, key: str) -> FileIndex | None:
    """The stored index of `path` (scanned with `key`: its kind and text field), if the file is unchanged."""
    if not index_dir:
        return None
    try:
        stat = path.stat()
        with open(_entry(Path(index_dir), path, key), "rb") as f:
            header = json.loads(f.readline())
            if (header["version"], header["size"], header["mtime_ns"]) != (VERSION, stat.st_size, stat.st_mtime_ns):
                return None
            n = header["documents"]
            offsets, lengths = array("q"), array("q")
            offsets.fromfile(f, n)
            lengths.fromfile(f, n)
    except (OSError, ValueError, KeyError, EOFError):
        return None
    return FileIndex(stat.st_size, stat.st_mtime_ns, header["digest"], offsets, lengths, header["notes"])


def store(index_dir: str | None, path: Path, key: str, index: FileIndex) -> None:
    """Keep `index` for the next process (best effort: an unwritable or full folder only costs a scan)."""
    if not index_dir:
        return
    entry = _entry(Path(index_dir), path, key)
    tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
    header = {
        "version": VERSION,
        "path": str(path),
        "size": index.size,
        "mtime_ns": index.mtime_ns,
        "digest": index.digest,
        "documents": len(index.offsets),
        "notes": index.notes,
    }
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(json.dumps(header).encode() + b"\n")
            index.offsets.tofile(f)
            index.lengths.tofile(f)
        os.replace(tmp, entry)
    except OSError:
        tmp.unlink(missing_ok=True)
