"""The record of a token folder's shards verified against their digests, kept in the data index folder.

Verifying a shard reads all of it (its BLAKE2b digest against the one `tokens.json` lists), so it is done
once per shard and folder state, not by every process: the process that verifies (the launcher's preflight,
once per node) records, beside the run's other data indexes (`<job.dump_folder>/data_index/`, `index.py`),
each verified shard's size, modification time and digest, with the digest of the `tokens.json` it was
checked against and the folder's modification time. A later verification re-reads only the shards whose
size or modification time changed; a rank trusts the record while `tokens.json` and the folder are those
recorded (no shard is opened or stat'ed), and verifies itself, under the record's lock, where there is none.

Stored as JSON: {"version", "folder", "index", "folder_mtime_ns", "shards": {file: [bytes, mtime_ns,
digest]}}, written under a temporary name and renamed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from titanlite.data import index

VERSION = 1
READERS = 16
"""Shards read at once by a verification (threads: reading and BLAKE2b release the GIL)."""
_CHUNK = 1 << 20


@dataclass
class VerifiedShards:
    """The record at `path` of a folder's shards verified against the `tokens.json` of digest `index_digest`."""

    path: Path
    index_digest: str
    folder_mtime_ns: int
    """The folder's modification time when recorded (-1: nothing recorded)."""
    shards: dict[str, list] = field(default_factory=dict)
    """file -> [bytes, mtime_ns, digest] as verified"""

    @classmethod
    def load(cls, index_dir: str, folder: Path, index_digest: str) -> VerifiedShards:
        """The record of `folder` kept in `index_dir`, or an empty one where it is missing, unreadable or of
        another `tokens.json`."""
        path = index.entry(index_dir, folder, "tokens", suffix=".verified")
        try:
            data = json.loads(path.read_text())
            if (data["version"], data["index"]) == (VERSION, index_digest):
                return cls(path, index_digest, int(data["folder_mtime_ns"]), dict(data["shards"]))
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return cls(path, index_digest, -1)

    def covers(self, folder_mtime_ns: int, digests: dict[str, str]) -> bool:
        """Every shard (file -> digest) was verified, in the folder as it is now (its modification time)."""
        if self.folder_mtime_ns != folder_mtime_ns:
            return False
        return all((self.shards.get(name) or [None] * 3)[2] == digest for name, digest in digests.items())

    def verified(self, name: str, size: int, mtime_ns: int, digest: str) -> bool:
        """Shard `name` as it is now (`size`, `mtime_ns`) was verified to have `digest`."""
        return self.shards.get(name) == [size, mtime_ns, digest]

    def store(self, folder: Path, folder_mtime_ns: int, shards: dict[str, list]) -> None:
        """Record `shards` (file -> [bytes, mtime_ns, digest]) as verified in the folder as of
        `folder_mtime_ns` (best effort: an unwritable folder only costs the next process a verification)."""
        data = {
            "version": VERSION,
            "folder": str(folder.resolve()),
            "index": self.index_digest,
            "folder_mtime_ns": folder_mtime_ns,
            "shards": shards,
        }
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(data))
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)


def _read(path: Path, head: int) -> tuple[bytes, str] | OSError:
    """The first `head` bytes of a file and the BLAKE2b digest of all of it (the tokenize tool's)."""
    digest = hashlib.blake2b(digest_size=16)
    try:
        with open(path, "rb") as f:
            first = f.read(head)
            digest.update(first)
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    except OSError as e:
        return e
    return first, digest.hexdigest()


@contextlib.contextmanager
def digests(files: list[Path], head: int) -> Iterator[Iterator[tuple[bytes, str] | OSError]]:
    """Each file's first `head` bytes and digest (or the error reading it), in order, read by `READERS`
    threads at once; leaving early cancels the reads not begun."""
    with ThreadPoolExecutor(max_workers=max(1, min(READERS, len(files)))) as pool:
        futures = [pool.submit(_read, path, head) for path in files]
        try:
            yield (future.result() for future in futures)
        finally:
            for future in futures:
                future.cancel()
