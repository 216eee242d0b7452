"""Pre-tokenized data: a folder of binary token shards that the loader reads memory-mapped.

`python -m titanlite.tools.tokenize` writes it from a local dataset, tokenizing every document once
(BOS + text + EOS, exactly as a shard stream does on the fly: `dataset.py`); a run whose
`training.dataset_path` (or a mixture source's path) is such a folder reads the same tokens in the same
order, so its batches, block-causal masks and resume points are those of the text it came from.

Layout of the folder:

    tokens-plan.json    what is being made: format version, tokenizer (name, digest), dtype, source
                        (name, content digest, text field), documents, documents per shard; written first
    shard-00000.bin     documents [0, C) of the source, C = documents per shard, then [C, 2C), ...
    tokens.json         the plan plus each shard's documents, tokens, bytes and digest; written last, so
                        its presence means the folder is complete

A shard file is `MAGIC`, its document count n (uint64), the n + 1 token offsets of its documents
(int64, from 0), then the tokens: uint16 where every id fits (vocabularies of at most 65,536), else
uint32. Each shard is written under a temporary name and renamed, so a shard file that exists is whole:
an interrupted tokenization resumes by writing only the missing ones, and produces the same bytes.

The folder records the digest of the tokenizer that made it (`tokenizer.tokenizer_digest`, the one a
checkpoint records); the loader refuses a run whose tokenizer differs, and a folder without
`tokens.json` or with a shard of the wrong size (unfinished, truncated), one whose `tokens.json` lacks what
the tool writes, and a shard file that does not begin with `MAGIC`, each in one line.
"""

from __future__ import annotations

import bisect
import copy
import hashlib
import json
import mmap
import os
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from titanlite.errors import DataError

FORMAT = "titanlite-tokens"
VERSION = 1
PLAN, INDEX = "tokens-plan.json", "tokens.json"
MAGIC = b"TLTOKS01"
_HEADER = len(MAGIC) + 8
UINT16_VOCAB = 1 << 16


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

    def __init__(self, path: str) -> None:
        self.name = path
        try:
            self._open(Path(path))
        except (KeyError, TypeError, ValueError) as e:  # valid JSON, not what the tool writes
            what = f"has no {e.args[0]!r}" if isinstance(e, KeyError) else f"is malformed ({e})"
            raise DataError(f"dataset_path {path}: {INDEX} {what}: tokenize the data again") from None
        self._first = 0
        self._maps: dict[int, tuple[mmap.mmap, np.ndarray, np.ndarray]] = {}

    def _open(self, folder: Path) -> None:
        """Read and check the index and the shards' sizes and headers."""
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
        for file, entry in zip(self.files, self.meta["shards"]):
            size = file.stat().st_size if file.exists() else None
            if size != entry["bytes"]:
                found = "missing" if size is None else f"{size:,} bytes, not {entry['bytes']:,}"
                raise DataError(f"dataset_path {path}: shard {file.name} is {found}: tokenize the data again")
            with open(file, "rb") as f:
                check_magic(f.read(len(MAGIC)), file, f"dataset_path {path}", "tokenize the data again")
        self._starts = array("q", [0])  # each shard's first document
        for entry in self.meta["shards"][:-1]:
            self._starts.append(self._starts[-1] + entry["documents"])
        self.num_documents: int = self.meta["documents"]

    @property
    def tokenizer(self) -> dict:
        """{"name", "digest"} of the tokenizer that made the shards."""
        return self._made_by

    def part(self, begin: int, end: int) -> TokenShards:
        """Documents [begin, end) as a source numbered from 0 (`sources.LocalSource.part`)."""
        if not 0 <= begin <= end <= self.num_documents:
            raise ValueError(f"documents [{begin}, {end}) of {self.num_documents}")
        part = copy.copy(self)
        part._first, part.num_documents, part._maps = self._first + begin, end - begin, {}
        return part

    def _shard(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Shard k's (offsets, tokens), memory-mapped once per process."""
        if k not in self._maps:
            with open(self.files[k], "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            n = self.meta["shards"][k]["documents"]
            offsets = np.frombuffer(mapped, dtype=np.int64, count=n + 1, offset=_HEADER)
            tokens = np.frombuffer(mapped, dtype=self.dtype, offset=_HEADER + 8 * (n + 1))
            self._maps[k] = (mapped, offsets, tokens)
        return self._maps[k][1:]

    def document(self, d: int) -> list[int]:
        """Document `d`'s tokens, BOS and EOS included."""
        d += self._first
        k = bisect.bisect_right(self._starts, d) - 1
        offsets, tokens = self._shard(k)
        i = d - self._starts[k]
        ids = tokens[offsets[i] : offsets[i + 1]]
        # The sizes and headers are checked up front, the contents here: a flipped bit that makes an id no
        # token of the tokenizer would otherwise reach the embedding (an index error; on CUDA an assert).
        if len(ids) and int(ids.max()) >= self.vocab_size:
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
        """Picklable for spawned dataloader workers: maps stay behind."""
        return {**self.__dict__, "_maps": {}}


def read_json(path: Path, name: str, remedy: str = "tokenize the data again") -> dict:
    """A JSON object the folder holds, or a `DataError` naming `name` and the `remedy`."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{name}: cannot read {path.name} ({e}): {remedy}") from None
    if not isinstance(data, dict):
        raise DataError(f"{name}: {path.name} is not a JSON object: {remedy}")
    return data
