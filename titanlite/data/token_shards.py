"""Pre-tokenized data: a folder of binary token shards that the loader reads document by document.

`python -m titanlite.tools.tokenize` writes it from a local dataset, every document once as BOS + text +
EOS, as a shard stream does on the fly (`dataset.py`), so a run reading the folder gets the same
batches, masks and resume points as from the text. `tokens-plan.json` is written first, the shards
`shard-<k>.bin` (`MAGIC`, the document count, the n + 1 token offsets, then uint16 or uint32 tokens)
each under a temporary name and renamed, and `tokens.json` last, so its presence means the folder is
complete. The loader refuses a folder of another tokenizer or with a damaged shard, each in one line
(digests: `verified_shards.py`). A document is read with two `os.pread` calls from one of the last
`open_files.OPEN_FILES` shards opened. The format and the reasons for this read path: docs/configuration.md.
"""

from __future__ import annotations

import bisect
import copy
import hashlib
import json
import os
import struct
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from titanlite.data import index, verified_shards
from titanlite.data.open_files import OpenFiles
from titanlite.data.verified_shards import VerifiedShards
from titanlite.errors import DataError

FORMAT = "titanlite-tokens"
VERSION = 1
PLAN, INDEX = "tokens-plan.json", "tokens.json"
MAGIC = b"TLTOKS01"
_HEADER = len(MAGIC) + 8
UINT16_VOCAB = 1 << 16
_SPAN = struct.Struct("=2q")  # a document's offsets: its first token and the next document's


def token_dtype(vocab_size: int) -> str:
    """The narrowest dtype that holds every id of a vocabulary."""
    return "uint16" if vocab_size <= UINT16_VOCAB else "uint32"


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.bin"


def is_token_folder(path: str) -> bool:
    """A folder the tokenize tool made or began (it holds its plan or its index)."""
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, f)) for f in (PLAN, INDEX))


def write_json(path: Path, data: dict) -> None:
    """`data` as JSON at `path`, atomically (a reader sees the old file or the whole new one)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


@dataclass(frozen=True)
class WrittenShard:
    """What a shard holds, as `tokens.json` lists it."""

    file: str
    documents: int
    tokens: int
    bytes: int
    digest: str


def write_shard(path: Path, documents: Iterable[list[int]], dtype: str) -> WrittenShard:
    """Write the tokenized `documents` as one shard file at `path`, atomically (module docstring)."""
    offsets, tokens = array("q", [0]), np.array([], dtype=dtype)
    pieces = []
    for doc in documents:
        pieces.append(np.asarray(doc, dtype=dtype))
        offsets.append(offsets[-1] + len(doc))
    tokens = np.concatenate(pieces) if pieces else tokens
    data = MAGIC + (len(offsets) - 1).to_bytes(8, "little") + offsets.tobytes() + tokens.tobytes()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    digest = hashlib.blake2b(data, digest_size=16).hexdigest()
    return WrittenShard(path.name, len(offsets) - 1, int(offsets[-1]), len(data), digest)


def read_shard(path: Path) -> WrittenShard:
    """A whole shard file's entry (a resumed tokenization lists the shards written before)."""
    data = path.read_bytes()
    check_magic(data[: len(MAGIC)], path, f"--out {path.parent}", f"delete {path.name} to write it again")
    n = int.from_bytes(data[len(MAGIC) : _HEADER], "little")
    end = np.frombuffer(data, dtype=np.int64, count=1, offset=_HEADER + 8 * n)[0]
    return WrittenShard(path.name, n, int(end), len(data), hashlib.blake2b(data, digest_size=16).hexdigest())


def check_magic(head: bytes, path: Path, name: str, remedy: str) -> None:
    """Refuse a file that does not begin as a shard file does (another file under a shard's name)."""
    if head != MAGIC:
        raise DataError(f"{name}: shard {path.name} is not a token shard (it begins {head!r}, not {MAGIC!r}): {remedy}")


class TokenShards:
    """A tokenized folder as a document source (`sources.DocumentSource`) whose documents are token lists.

    `files` and `digests` are its shard files and their content digests (the dataset fingerprint's)."""

    def __init__(self, path: str, index_dir: str | None = None, verify: bool = False) -> None:
        self.name = path
        try:
            self._open(Path(path), index_dir, verify)
        except (KeyError, TypeError, ValueError) as e:  # valid JSON, not what the tool writes
            what = f"has no {e.args[0]!r}" if isinstance(e, KeyError) else f"is malformed ({e})"
            raise DataError(f"dataset_path {path}: {INDEX} {what}: tokenize the data again") from None
        self._first = 0
        self._files: OpenFiles[int] = OpenFiles(os.close)  # shard number -> file descriptor
        self._checked: set[int] = set()  # the shards whose offsets this process checked

    def _open(self, folder: Path, index_dir: str | None, verify: bool) -> None:
        """Read and check the index, then the shards (`_check_shards`)."""
        path = self.name
        if not (folder / INDEX).exists():
            plan = read_json(folder / PLAN, f"dataset_path {path}")
            total = -(-plan["documents"] // plan["documents_per_shard"])
            done = len([k for k in range(total) if (folder / shard_name(k)).exists()])
            raise DataError(
                f"dataset_path {path}: an unfinished tokenization ({done} of {total} shards); run the same "
                "titanlite.tools.tokenize command again to finish it"
            )
        self.meta = read_json(folder / INDEX, f"dataset_path {path}")
        if self.meta.get("format") != FORMAT or self.meta.get("version") != VERSION:
            raise DataError(
                f"dataset_path {path}: {INDEX} is format {self.meta.get('format')} version {self.meta.get('version')}, "
                f"this titanlite reads {FORMAT} version {VERSION}: tokenize the data again"
            )
        self._made_by = {"name": str(self.meta["tokenizer"]["name"]), "digest": str(self.meta["tokenizer"]["digest"])}
        self.dtype = np.dtype(self.meta["dtype"])
        self.vocab_size = int(self.meta["vocab_size"])
        self.files = [folder / s["file"] for s in self.meta["shards"]]
        self.digests = [s["digest"] for s in self.meta["shards"]]
        self._check_shards(folder, index_dir, verify)
        self._starts = array("q", [0])  # each shard's first document
        for entry in self.meta["shards"][:-1]:
            self._starts.append(self._starts[-1] + entry["documents"])
        self.num_documents: int = self.meta["documents"]

    def _check_shards(self, folder: Path, index_dir: str | None, verify: bool) -> None:
        """Each shard's size, header and digest against `tokens.json`, read once per folder state and recorded
        in `index_dir` (`verified_shards.py`): `verify` (the preflight) checks every size and reads the shards
        not recorded as they are; otherwise a record covering this folder is trusted as it is, and only where
        there is none this process verifies, while the others wait. Without an `index_dir` (tools, tests),
        sizes and headers only, unless `verify`."""
        if not index_dir:
            self._verify(None, 0, read=verify)
            return
        index_digest = hashlib.blake2b(json.dumps(self.meta, sort_keys=True).encode(), digest_size=16).hexdigest()
        folder_mtime_ns = folder.stat().st_mtime_ns  # before the shards': a change while verifying is seen next time
        digests = {file.name: digest for file, digest in zip(self.files, self.digests)}
        record = VerifiedShards.load(index_dir, folder, index_digest)
        if not verify and record.covers(folder_mtime_ns, digests):
            return
        with index.building(record.path):
            record = VerifiedShards.load(index_dir, folder, index_digest)  # made while this process waited
            if verify or not record.covers(folder_mtime_ns, digests):
                self._verify(record, folder_mtime_ns, read=True)

    def _verify(self, record: VerifiedShards | None, folder_mtime_ns: int, read: bool) -> None:
        """Check every shard's size, then read those `record` lacks as they are now (all without one) for their
        header and digest, `verified_shards.READERS` at once, and record what was verified (also before a
        refusal: the folder once fixed is not read again in full). Not `read`: sizes and headers only."""
        where, remedy = f"dataset_path {self.name}", "tokenize the data again"
        shards: dict[str, list] = {}
        todo = []
        for file, entry in zip(self.files, self.meta["shards"]):
            try:
                stat = os.stat(file)
            except (FileNotFoundError, NotADirectoryError):
                raise DataError(f"{where}: shard {file.name} is missing: {remedy}") from None
            if stat.st_size != entry["bytes"]:
                found = f"{stat.st_size:,} bytes, not {entry['bytes']:,}"
                raise DataError(f"{where}: shard {file.name} is {found}: {remedy}")
            now = [stat.st_size, stat.st_mtime_ns, entry["digest"]]
            if record is not None and record.verified(file.name, *now):
                shards[file.name] = now
            else:
                todo.append((file, now))
        if not read:
            for file, _ in todo:
                with open(file, "rb") as f:
                    check_magic(f.read(len(MAGIC)), file, where, remedy)
            return
        try:
            with verified_shards.digests([file for file, _ in todo], len(MAGIC)) as results:
                for (file, now), result in zip(todo, results):
                    if isinstance(result, OSError):
                        raise DataError(f"{where}: cannot read shard {file.name} ({result.strerror}): {remedy}")
                    head, digest = result
                    check_magic(head, file, where, remedy)
                    if digest != now[2]:
                        raise DataError(
                            f"{where}: shard {file.name} does not match its digest in {INDEX} (its bytes changed "
                            f"since it was written: a damaged file): {remedy}"
                        )
                    shards[file.name] = now
        finally:
            if record is not None:
                record.store(Path(self.name), folder_mtime_ns, shards)

    @property
    def tokenizer(self) -> dict:
        """{"name", "digest"} of the tokenizer that made the shards."""
        return self._made_by

    def part(self, begin: int, end: int) -> TokenShards:
        """Documents [begin, end) as a source numbered from 0 (`local_source.LocalSource.part`), sharing this one's
        open shards and checks."""
        if not 0 <= begin <= end <= self.num_documents:
            raise ValueError(f"documents [{begin}, {end}) of {self.num_documents}")
        part = copy.copy(self)
        part._first, part.num_documents = self._first + begin, end - begin
        return part

    def _shard(self, k: int) -> int:
        """Shard k's file descriptor, among the last `OPEN_FILES` opened (module docstring)."""
        return self._files.get(k, self._open_shard)

    def _open_shard(self, k: int) -> int:
        fd = os.open(self.files[k], os.O_RDONLY)
        try:
            if k not in self._checked:
                self._check_offsets(k, fd)
                self._checked.add(k)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _tokens_at(self, k: int) -> int:
        """Where shard k's tokens begin in its file."""
        return _HEADER + 8 * (self.meta["shards"][k]["documents"] + 1)

    def _check_offsets(self, k: int, fd: int) -> None:
        """Refuse a shard whose offsets do not run from 0 to its last token, increasing (every document holds
        its EOS at least): damaged at the right size, they would cut documents wrongly or empty (and a pass of
        empty documents never ends). Once per process and shard, over all its offsets at once."""
        n = self.meta["shards"][k]["documents"]
        tokens = (os.fstat(fd).st_size - self._tokens_at(k)) // self.dtype.itemsize
        offsets = np.frombuffer(os.pread(fd, 8 * (n + 1), _HEADER), dtype=np.int64)
        bad = np.flatnonzero((offsets[1:] <= offsets[:-1]) | (offsets[1:] > tokens))
        if offsets[0] != 0:
            why = f"they begin at token {offsets[0]:,}, not 0"
        elif len(bad):
            i = int(bad[0])
            d = self._starts[k] + i
            why = f"document {d} is tokens [{offsets[i]:,}, {offsets[i + 1]:,}) of the shard's {tokens:,}"
        elif offsets[-1] != tokens:
            why = f"they end at token {offsets[-1]:,} of the shard's {tokens:,}"
        else:
            return
        raise DataError(
            f"dataset_path {self.name}: shard {self.files[k].name} has damaged document offsets ({why}): "
            "tokenize the data again"
        )

    def document(self, d: int) -> list[int]:
        """Document `d`'s tokens, BOS and EOS included."""
        d += self._first
        k = bisect.bisect_right(self._starts, d) - 1
        fd = self._shard(k)
        begin, end = _SPAN.unpack(os.pread(fd, _SPAN.size, _HEADER + 8 * (d - self._starts[k])))
        size = self.dtype.itemsize
        data = os.pread(fd, (end - begin) * size, self._tokens_at(k) + begin * size)
        if len(data) != (end - begin) * size:
            raise DataError(
                f"dataset_path {self.name}: shard {self.files[k].name} ends inside document {d} (it changed "
                "while training read it): tokenize the data again"
            )
        ids = np.frombuffer(data, dtype=self.dtype)
        # The sizes and headers are checked up front, the offsets when a shard is first opened, the ids here: a
        # flipped bit that makes an id no token of the tokenizer would otherwise reach the embedding (an index
        # error; on CUDA an assert).
        if int(ids.max()) >= self.vocab_size:
            raise DataError(
                f"dataset_path {self.name}: shard {self.files[k].name} holds token id {int(ids.max())} in document "
                f"{d}, beyond the tokenizer's {self.vocab_size} ids (a damaged file): tokenize the data again"
            )
        return ids.tolist()

    def shard_documents(
        self, shard: int, num_shards: int, start: int, position: dict | None = None
    ) -> Iterator[list[int]]:
        for d in range(shard + start * num_shards, self.num_documents, num_shards):
            yield self.document(d)

    def check_tokenizer(self, digest: str, name: str) -> None:
        """Refuse a run whose tokenizer is not the one that made the shards (its ids would mean other words)."""
        made = self.tokenizer
        if made["digest"] != digest:
            raise DataError(
                f"dataset_path {self.name} was tokenized with {made['name']} (digest {made['digest']}), this run's "
                f"tokenizer is {name} (digest {digest}): set model.tokenizer_path to that one, or tokenize the "
                "data again with this one"
            )

    def __getstate__(self) -> dict:
        """Picklable for spawned dataloader workers: each process opens and checks the shards itself."""
        return {**self.__dict__, "_checked": set()}


def read_json(path: Path, name: str, remedy: str = "tokenize the data again") -> dict:
    """A JSON object the folder holds, or a `DataError` naming `name` and the `remedy`."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{name}: cannot read {path.name} ({e}): {remedy}") from None
    if not isinstance(data, dict):
        raise DataError(f"{name}: {path.name} is not a JSON object: {remedy}")
    return data
