"""Document sources: where text comes from, in one deterministic global order.

A source enumerates documents (non-empty strings) in a fixed global order, so that document `d`
always lands in the same virtual shard (`d % V`, see `dataset.py`) whatever the data-parallel
layout. It serves one shard's documents (`shard`, `shard + V`, ...) from a given ordinal, which is
all a shard stream needs to start, resume or begin a new epoch.

Local data (`LocalSource`): files sorted by path, documents in file order.

- `.txt` (and `.txt.gz`): documents are separated by one or more blank lines.
- `.jsonl` (and `.jsonl.gz`): one JSON object per line, the text in `text_field`.
- `.parquet` (needs pyarrow): column `text_field`.

All files are scanned once, at start-up, into an index of document byte offsets (row numbers for
parquet): that validates the data up front (bad records are skipped with one counted warning per
file, never a crash), gives the document count, and lets a shard seek straight to its documents
at any epoch or resume point instead of re-reading everything before them. Only the shard streams
tokenize, and only their own documents.

Hugging Face (`HFSource`, `hf://name[:config][@split]`): streamed with `datasets` (imported lazily);
each shard stream iterates the dataset and keeps every V-th usable record. Streams have no index,
so every owned shard reads the whole stream: prefer few virtual shards per rank there.
"""

from __future__ import annotations

import bisect
import glob
import gzip
import json
import logging
import mmap
import os
import re
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Protocol

from titanlite.errors import DataError

logger = logging.getLogger("titanlite")

BUNDLED_CORPUS = Path(__file__).resolve().parent / "corpus"
TEXT_SUFFIXES = (".txt", ".txt.gz")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES

_BLANK_LINES = re.compile(rb"\n(?:[ \t\r\f\v]*\n)+")  # a document separator in .txt files
_BINARY_SNIFF = 8192  # like git: a NUL byte in the first 8 KiB means a binary file
_OPEN_FILES = 8  # LRU of mapped/decompressed files; shard streams advance roughly together


class DocumentSource(Protocol):
    name: str
    num_documents: int | None
    """Documents in one pass, or None when unknown before the end (streams)."""

    def shard_documents(self, shard: int, num_shards: int, start: int) -> Iterator[str]:
        """Documents `shard + i * num_shards` for i = start, start + 1, ... until the end of the pass."""
        ...


def record_text(record: object, field: str) -> tuple[str | None, str]:
    """The usable text of a JSON record, or (None, why it is unusable)."""
    if not isinstance(record, dict):
        return None, "not a JSON object"
    if field not in record:
        return None, f"no {field!r} field"
    text = record[field]
    if not isinstance(text, str):
        return None, f"non-string {field!r}"
    if not text.strip():
        return None, f"empty {field!r}"
    return text, ""


def _jsonl_text(line: bytes, field: str) -> tuple[str | None, str]:
    try:
        record = json.loads(line)
    except ValueError:  # also UnicodeDecodeError
        return None, "invalid JSON"
    return record_text(record, field)


def resolve_files(path: str) -> list[Path]:
    """The supported files named by a file, a directory (recursive) or a glob, sorted by path."""
    if os.path.isfile(path):
        if not path.endswith(SUPPORTED_SUFFIXES):
            raise DataError(f"dataset_path {path}: unsupported file type (use {', '.join(SUPPORTED_SUFFIXES)})")
        return [Path(path)]
    found: set[str] = set()
    for match in [path] if os.path.isdir(path) else glob.glob(path, recursive=True):
        if os.path.isdir(match):
            for dirpath, _, filenames in os.walk(match):
                found.update(os.path.join(dirpath, name) for name in filenames)
        else:
            found.add(match)
    files = sorted(Path(f) for f in found if f.endswith(SUPPORTED_SUFFIXES) and os.path.isfile(f))
    if not files:
        raise DataError(f"dataset_path {path!r} matches no {', '.join(SUPPORTED_SUFFIXES)} file")
    return files


class LocalSource:
    """Local files, indexed once: document d -> (file, byte offset, byte length)."""

    def __init__(self, files: list[Path], text_field: str, name: str) -> None:
        self.name = name
        self.files = files
        self.text_field = text_field
        self._starts = array("q")  # index of each file's first document
        self._offsets = array("q")  # byte offset (parquet: row number)
        self._lengths = array("q")
        self._cache: OrderedDict[int, object] = OrderedDict()
        if any(f.name.endswith(PARQUET_SUFFIXES) for f in files):
            _require_pyarrow()
        for path in files:
            self._starts.append(len(self._offsets))
            self._index(path)
        self.num_documents: int = len(self._offsets)

    def _index(self, path: Path) -> None:
        try:
            data = self._read(path)
        except (OSError, EOFError, ValueError) as e:  # unreadable, corrupt gzip/parquet
            logger.warning(f"data: skipped {path}: cannot read it ({e})")
            return
        try:
            self._index_data(path, data)
        finally:
            if isinstance(data, mmap.mmap):
                data.close()

    def _index_data(self, path: Path, data: bytes | mmap.mmap | list[str | None]) -> None:
        issues: Counter[str] = Counter()
        spans: list[tuple[int, int]] = []
        if isinstance(data, list):
            spans = [(row, 0) for row, text in enumerate(data) if text is not None]
            issues["rows without usable text"] = len(data) - len(spans)
        elif b"\0" in data[:_BINARY_SNIFF]:
            logger.warning(f"data: skipped {path}: binary file")
            return
        elif path.name.endswith(TEXT_SUFFIXES):
            spans = _scan_txt(data, issues)
        else:
            spans = _scan_jsonl(data, self.text_field, issues)
        self._offsets.extend(off for off, _ in spans)
        self._lengths.extend(n for _, n in spans)
        issues = +issues  # drop zero counts
        if not spans and not issues:
            logger.warning(f"data: skipped {path}: empty file")
        elif issues:
            detail = ", ".join(f"{n} {why}" for why, n in sorted(issues.items()))
            logger.warning(f"data: {path}: skipped {detail}; kept {len(spans)} documents")

    def _read(self, path: Path) -> bytes | mmap.mmap | list[str | None]:
        """A file's bytes (mapped, or decompressed) or a parquet text column."""
        if path.name.endswith(PARQUET_SUFFIXES):
            return _read_parquet_column(path, self.text_field)
        if path.name.endswith(".gz"):
            return gzip.decompress(path.read_bytes())
        if path.stat().st_size == 0:
            return b""
        with open(path, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def _load(self, i: int) -> bytes | mmap.mmap | list[str | None]:
        """`_read`, with a small LRU cache: shard streams read documents of the same few files."""
        if i in self._cache:
            self._cache.move_to_end(i)
            return self._cache[i]  # type: ignore[return-value]
        data = self._cache[i] = self._read(self.files[i])
        if len(self._cache) > _OPEN_FILES:
            _, old = self._cache.popitem(last=False)
            if isinstance(old, mmap.mmap):
                old.close()
        return data

    def document(self, d: int) -> str:
        i = bisect.bisect_right(self._starts, d) - 1  # empty files share their successor's start
        data = self._load(i)
        if isinstance(data, list):
            return data[self._offsets[d]]  # type: ignore[return-value]
        raw = data[self._offsets[d] : self._offsets[d] + self._lengths[d]]
        if self.files[i].name.endswith(TEXT_SUFFIXES):
            return raw.decode("utf-8")
        return json.loads(raw)[self.text_field]

    def shard_documents(self, shard: int, num_shards: int, start: int) -> Iterator[str]:
        for d in range(shard + start * num_shards, self.num_documents, num_shards):
            yield self.document(d)

    def __getstate__(self) -> dict:
        """Picklable for spawned dataloader workers: open maps stay behind."""
        return {**self.__dict__, "_cache": OrderedDict()}


def _scan_txt(data: bytes | mmap.mmap, issues: Counter[str]) -> list[tuple[int, int]]:
    """(offset, length) of each blank-line-separated, valid UTF-8 paragraph, whitespace trimmed."""
    spans = []
    pos = 0
    separators = [(m.start(), m.end()) for m in _BLANK_LINES.finditer(data)]
    for end, next_pos in separators + [(len(data), len(data))]:
        chunk = data[pos:end]
        text = chunk.strip()
        if text:
            try:
                text.decode("utf-8")
                spans.append((pos + len(chunk) - len(chunk.lstrip()), len(text)))
            except UnicodeDecodeError:
                issues["undecodable paragraphs"] += 1
        pos = next_pos
    return spans


def _scan_jsonl(data: bytes | mmap.mmap, field: str, issues: Counter[str]) -> list[tuple[int, int]]:
    """(offset, length) of each line that is a JSON object with a non-empty string `field`."""
    spans = []
    pos, size = 0, len(data)
    while pos < size:
        end = data.find(b"\n", pos)
        end = size if end < 0 else end
        line = data[pos:end]
        if line.strip():
            text, why = _jsonl_text(line, field)
            if text is None:
                issues[f"lines with {why}"] += 1
            else:
                spans.append((pos, end - pos))
        pos = end + 1
    return spans


def _require_pyarrow() -> None:
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise DataError("reading .parquet files needs pyarrow: pip install pyarrow") from None


def _read_parquet_column(path: Path, field: str) -> list[str | None]:
    """The text column, with None for rows that have no usable text."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    if field not in table.column_names:
        raise ValueError(f"no column {field!r} (columns: {', '.join(table.column_names)})")
    return [t if isinstance(t, str) and t.strip() else None for t in table.column(field).to_pylist()]


class HFSource:
    """A Hugging Face dataset, streamed: `hf://name[:config][@split]` (split defaults to train)."""

    num_documents = None

    def __init__(self, spec: str, text_field: str) -> None:
        self.name = spec
        rest, _, split = spec.removeprefix("hf://").partition("@")
        self.dataset, _, config = rest.partition(":")
        self.config = config or None
        self.split = split or "train"
        self.text_field = text_field
        if not self.dataset:
            raise DataError(f"dataset_path {spec!r}: expected hf://name[:config][@split]")
        try:
            import datasets  # noqa: F401
        except ImportError:
            raise DataError(f"dataset_path {spec}: streaming from Hugging Face needs `pip install datasets`") from None

    def _texts(self) -> Iterator[str]:
        import datasets

        try:
            rows = datasets.load_dataset(self.dataset, self.config, split=self.split, streaming=True)
        except Exception as e:  # unknown dataset, config or split; no network: report in one line
            raise DataError(f"dataset_path {self.name}: {type(e).__name__}: {e}") from None
        for row in rows:
            text, _ = record_text(row, self.text_field)
            if text is not None:
                yield text

    def shard_documents(self, shard: int, num_shards: int, start: int) -> Iterator[str]:
        return islice(self._texts(), shard + start * num_shards, None, num_shards)


def open_source(dataset_path: str, text_field: str) -> DocumentSource:
    """The source for a dataset path: "" is the bundled corpus, `hf://...` a Hugging Face dataset."""
    if dataset_path.startswith("hf://"):
        return HFSource(dataset_path, text_field)
    path = dataset_path or str(BUNDLED_CORPUS)
    return LocalSource(resolve_files(path), text_field, name=path)
