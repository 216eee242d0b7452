"""Document sources: where text comes from, in one deterministic global order.

A source enumerates documents (non-empty strings) in a fixed global order, so document `d` always lands
in virtual shard `d % V` (`dataset.py`) whatever the data-parallel layout, and serves one shard's
documents (`shard`, `shard + V`, ...) from any ordinal: all a shard stream needs to start, resume or
begin an epoch. `LocalSource` reads files sorted by path (`.txt`, `.jsonl`/`.json`, each plain, `.gz`
or `.zst`, and `.parquet`), scanned once into an index (`index.py`) that validates them, counts bad
records and lets a shard seek straight to its documents; files are streamed, never read whole.
`HFSource` (`hf://name[:config][@split]`) streams with `datasets`, virtual shard v being
`split_dataset_by_node(stream, rank=v, world_size=V)`. The formats and the splits: docs/configuration.md#data.
"""

from __future__ import annotations

import bisect
import copy
import glob
import gzip
import io
import json
import logging
import mmap
import os
import re
from array import array
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, Literal, Protocol

import numpy as np

from titanlite.data import index
from titanlite.data.data_source import DataSource, HFDataset
from titanlite.data.open_files import OpenFiles
from titanlite.data.token_shards import TokenShards, is_token_folder
from titanlite.errors import DataError

logger = logging.getLogger("titanlite")

BUNDLED_CORPUS = Path(__file__).resolve().parent / "corpus"
Kind = Literal["txt", "jsonl", "parquet"]
Compression = Literal["", "gz", "zst"]
FORMATS: dict[str, tuple[Kind, Compression]] = {
    ".txt": ("txt", ""),
    ".txt.gz": ("txt", "gz"),
    ".txt.zst": ("txt", "zst"),
    ".jsonl": ("jsonl", ""),
    ".jsonl.gz": ("jsonl", "gz"),
    ".jsonl.zst": ("jsonl", "zst"),
    ".json": ("jsonl", ""),
    ".json.gz": ("jsonl", "gz"),
    ".json.zst": ("jsonl", "zst"),
    ".parquet": ("parquet", ""),
}
"""Lower-cased suffix -> (what the file holds, its compression)."""
SUPPORTED_SUFFIXES = tuple(FORMATS)
_LONGEST_FIRST = sorted(FORMATS, key=len, reverse=True)

_BOM = b"\xef\xbb\xbf"  # UTF-8 byte-order mark, as some editors start .txt files
_BINARY_SNIFF = 8192  # like git: a NUL byte in the first 8 KiB means a binary file
_SKIP_CHUNK = 64 << 10  # decompress-and-discard step of a forward seek


class DocumentSource(Protocol):
    name: str
    num_documents: int | None
    """Documents in one pass, or None when unknown before the end (streams)."""

    def shard_documents(
        self, shard: int, num_shards: int, start: int, position: dict | None = None
    ) -> Iterator[str] | Iterator[list[int]]:
        """Documents `shard + i * num_shards` for i = start, start + 1, ... until the end of the pass.

        Streams also take the `position()` their iterator reported before document `start` (the resume
        point, then `start` is not skipped again); an iterator with a `position()` method reports it.
        Pre-tokenized data (`token_shards.py`) yields each document's tokens, BOS and EOS included."""
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


def file_format(path: str | Path) -> tuple[Kind, Compression] | None:
    """(kind, compression) of a file by its suffix, in any case; None for an unsupported file."""
    name = os.path.basename(path).lower()
    for suffix in _LONGEST_FIRST:
        if name.endswith(suffix):
            return FORMATS[suffix]
    return None


def _walk(path: str) -> tuple[list[Path], Counter[str]]:
    """(supported files, sorted by path; count of the other files by lower-cased suffix) under `path`."""
    found: set[str] = set()
    for match in [path] if os.path.isdir(path) else glob.glob(path, recursive=True):
        if os.path.isdir(match):
            for dirpath, _, filenames in os.walk(match):
                found.update(os.path.join(dirpath, name) for name in filenames)
        elif os.path.isfile(match):
            found.add(match)
    files = sorted(Path(f) for f in found if file_format(f) is not None)
    skipped = Counter(Path(f).suffix.lower() or "(no suffix)" for f in found if file_format(f) is None)
    return files, skipped


def resolve_files(path: str) -> list[Path]:
    """The supported files named by a file, a directory (recursive) or a glob, sorted by path."""
    if os.path.isfile(path):
        if file_format(path) is None:
            raise DataError(f"dataset_path {path}: unsupported file type (use {', '.join(SUPPORTED_SUFFIXES)})")
        return [Path(path)]
    files, _ = _walk(path)
    if not files:
        raise DataError(f"dataset_path {path!r} matches no {', '.join(SUPPORTED_SUFFIXES)} file")
    return files


def counted(n: int, noun: str) -> str:
    """`n` and the noun, plural unless n is one ("1 document", "3 files"): the data's lines count both."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def warn_skipped_files(path: str) -> None:
    """One warning per unsupported suffix among the files `path` names, with their count."""
    if os.path.isfile(path):
        return
    for suffix, n in sorted(_walk(path)[1].items()):
        files = counted(n, f"{suffix} file")
        logger.warning(f"data: skipped {files} in {path}: not one of {', '.join(SUPPORTED_SUFFIXES)}")


def _require_zstandard() -> None:
    try:
        import zstandard  # noqa: F401
    except ImportError:
        raise DataError("reading .zst files needs the zstandard package: pip install 'titanlite[data]'") from None


def open_stream(path: Path, compression: Compression) -> BinaryIO:
    """The file's (decompressed) bytes as a buffered binary stream, read incrementally."""
    if compression == "gz":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if compression == "zst":
        return io.BufferedReader(ZstdFrames(path))  # type: ignore[return-value]
    return open(path, "rb")


class ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a .zst file, frame after frame (parallel compressors write several).

    zstandard's own stream reader returns a truncated file's bytes as if it were whole; here a file that
    ends inside a frame raises EOFError, as a truncated gzip file does, so the file is reported.
    """

    def __init__(self, path: Path) -> None:
        import zstandard

        self._dctx = zstandard.ZstdDecompressor(max_window_size=1 << 31)  # also files made with --long
        self._file = open(path, "rb")
        self._frame = self._dctx.decompressobj()
        self._in_frame = False  # the current frame has had input
        self._out = memoryview(b"")  # decompressed, not yet read

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        while not self._out:
            data = self._file.read(_SKIP_CHUNK)
            if not data:
                if self._in_frame and not self._frame.eof:
                    raise EOFError("the file ends inside a Zstandard frame (truncated)")
                return 0
            self._out = memoryview(self._decompress(data))
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def _decompress(self, data: bytes) -> bytes:
        out = []
        while data:
            if self._frame.eof:
                self._frame = self._dctx.decompressobj()
            self._in_frame = True
            out.append(self._frame.decompress(data))
            data = self._frame.unused_data if self._frame.eof else b""
        return b"".join(out)

    def close(self) -> None:
        self._file.close()
        super().close()


def _read_errors() -> tuple[type[BaseException], ...]:
    """What reading a damaged file raises: I/O, truncated or corrupt gzip/parquet, corrupt zstd."""
    errors: tuple[type[BaseException], ...] = (OSError, EOFError, ValueError)
    try:
        import zstandard

        errors += (zstandard.ZstdError,)
    except ImportError:
        pass
    return errors


class ForwardReader:
    """Reads byte ranges of a (compressed) stream in increasing order by decompressing forward; an
    earlier offset (the next pass) reopens the file."""

    def __init__(self, path: Path, compression: Compression) -> None:
        self.path, self.compression = path, compression
        self._f: BinaryIO | None = None
        self._pos = 0

    def read(self, offset: int, length: int) -> bytes:
        if self._f is None or offset < self._pos:
            self.close()
            self._f, self._pos = open_stream(self.path, self.compression), 0
        while self._pos < offset:
            chunk = self._f.read(min(offset - self._pos, _SKIP_CHUNK))
            if not chunk:
                raise EOFError(f"{self.path} ended before byte {offset}")
            self._pos += len(chunk)
        data = self._f.read(length)
        self._pos += len(data)
        return data

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


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
            _require_pyarrow()
        if any(compression == "zst" for _, compression in self.formats):
            _require_zstandard()
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
        """Scan one file: its documents, a digest of its content and what was wrong with it."""
        kind, compression = self.formats[i]
        stat = path.stat()
        found = index.FileIndex(stat.st_size, stat.st_mtime_ns)
        digest = index.content_hash()
        issues: Counter[str] = Counter()
        spans: list[tuple[int, int]] = []  # filled as the scan goes: a file that breaks keeps its first part
        error = None
        head = b""
        try:
            if kind == "parquet":
                with open(path, "rb") as f:
                    while chunk := f.read(_SKIP_CHUNK):
                        digest.update(chunk)
                column = _read_parquet_column(path, self.text_field)
                spans = [(row, 0) for row, text in enumerate(column) if text is not None]
                issues["rows without usable text"] = len(column) - len(spans)
            else:
                with open_stream(path, compression) as f:
                    head = f.read(_BINARY_SNIFF)
                if b"\0" in head:
                    digest.update(head)
                    found.digest = digest.hexdigest()
                    found.notes.append(f"data: skipped {path}: binary file")
                    return found
                with open_stream(path, compression) as f:
                    pos = len(_BOM) if head.startswith(_BOM) else 0
                    digest.update(f.read(pos))
                    scan = _scan_txt if kind == "txt" else _scan_jsonl
                    scan(f, pos, self.text_field, issues, spans, digest)
        except _read_errors() as e:  # unreadable, corrupt or truncated gzip/zstd/parquet
            error = e
        found.digest = digest.hexdigest()
        found.spans = index.Spans.of(spans)
        issues = +issues  # drop zero counts
        if error is not None:
            what = f"kept the {counted(len(spans), 'document')} before the damage" if spans else "nothing readable"
            found.notes.append(f"data: {path}: cannot read all of it ({error}); {what}")
        elif not spans and not issues:
            found.notes.append(f"data: skipped {path}: empty file")
        elif issues:
            detail = ", ".join(f"{n} {why}" for why, n in sorted(issues.items()))
            hint = ""
            if kind == "jsonl" and head.lstrip(_BOM + b" \t\r\n").startswith(b"["):
                hint = (
                    " (it looks like one JSON array: JSON Lines is expected, one object per line; "
                    f"convert it with: jq -c '.[]' {path} > {path.with_suffix('.jsonl')})"
                )
            found.notes.append(f"data: {path}: skipped {detail}; kept {counted(len(spans), 'document')}{hint}")
        return found

    def _load(self, i: int) -> mmap.mmap | bytes | list[str | None]:
        """A plain file mapped, or a parquet text column, kept among the few last used (`open_files.py`):
        shard streams read documents of the same few files."""
        return self._cache.get(i, self._read)

    def _read(self, i: int) -> mmap.mmap | bytes | list[str | None]:
        path = self.files[i]
        if self.formats[i][0] == "parquet":
            return _read_parquet_column(path, self.text_field)
        if path.stat().st_size == 0:
            return b""
        with open(path, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def _span(self, i: int, j: int) -> tuple[int, int]:
        """(offset, length) of document j of file i, from the file's spans, kept mapped while among the last
        files read (`open_files.py`)."""
        table = self._tables.get(i, lambda k: self._spans[k].table())
        return int(table[0, j]), int(table[1, j])

    def document(self, d: int, readers: dict[int, ForwardReader] | None = None) -> str:
        """Document `d`. A compressed file is read through `readers[file]` (kept by the caller, so that
        reading forward resumes where it stopped), or decompressed from its start without one."""
        i = bisect.bisect_right(self._starts, d) - 1  # empty files share their successor's start
        kind, compression = self.formats[i]
        offset, length = self._span(i, d - self._starts[i])
        if kind == "parquet":
            return self._load(i)[offset]  # type: ignore[index,return-value]
        if compression:
            reader = (readers or {}).get(i) or ForwardReader(self.files[i], compression)
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
        readers: dict[int, ForwardReader] = {}
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


_PARAGRAPH = re.compile(rb"(?:^[ \t\r\x0b\x0c]*[^\s][^\n]*(?:\n|\Z))+", re.MULTILINE)
"""A paragraph: consecutive lines with a non-whitespace byte (`bytes.strip`'s whitespace is `\\s`)."""
_SCAN_CHUNK = 64 << 10


def _scan_txt(
    stream: BinaryIO, pos: int, field: str, issues: Counter[str], spans: list[tuple[int, int]], digest
) -> None:
    """Append (offset, length) of each paragraph (lines up to a blank one) that is valid UTF-8, whitespace
    trimmed, to `spans`; `pos` is the offset of the stream's first byte; every byte read goes into
    `digest`. Reads a chunk at a time and finds the paragraphs with one regular expression (the scan of a
    large text file is a start-up cost); a paragraph that may go on in the next chunk is carried over."""
    carry = b""
    while True:
        chunk = stream.read(_SCAN_CHUNK)
        digest.update(chunk)
        buffer = carry + chunk
        end = buffer.rfind(b"\n") + 1 if chunk else len(buffer)  # whole lines only, until the stream ends
        rest = end
        for m in _PARAGRAPH.finditer(buffer, 0, end):
            if chunk and m.end() == end:  # its next line is in the next chunk: it may go on there
                rest = m.start()
                break
            text = m.group()
            stripped = text.strip()
            try:
                stripped.decode("utf-8")
                spans.append((pos + m.start() + len(text) - len(text.lstrip()), len(stripped)))
            except UnicodeDecodeError:
                issues["undecodable paragraphs"] += 1
        if not chunk:
            return
        carry = buffer[rest:]
        pos += rest


def _scan_jsonl(
    lines: Iterable[bytes], pos: int, field: str, issues: Counter[str], spans: list[tuple[int, int]], digest
) -> None:
    """Append (offset, length) of each line that is a JSON object with a non-empty string `field` to
    `spans`; every line read goes into `digest`."""
    for line in lines:
        digest.update(line)
        if line.strip():
            text, why = _jsonl_text(line, field)
            if text is None:
                issues[f"lines with {why}"] += 1
            else:
                spans.append((pos, len(line.rstrip(b"\n"))))
        pos += len(line)


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

    def __init__(self, source: HFDataset, text_field: str) -> None:
        self.name = source.path
        self.dataset, self.config, self.split = source.name, source.config, source.split
        self.text_field = text_field
        self._stream = None  # the opened dataset, shared by this process's shard streams
        self._warned = False
        try:
            import datasets  # noqa: F401
        except ImportError:
            raise DataError(
                f"dataset_path {source.path}: streaming from Hugging Face needs `pip install datasets`"
            ) from None

    def _open(self):
        if self._stream is None:
            import datasets

            try:
                self._stream = datasets.load_dataset(self.dataset, self.config, split=self.split, streaming=True)
            except Exception as e:  # unknown dataset, config or split; no network: report in one line
                raise DataError(f"dataset_path {self.name}: {type(e).__name__}: {e}") from None
        return self._stream

    def shard_documents(
        self, shard: int, num_shards: int, start: int, position: dict | None = None
    ) -> HFShardDocuments:
        from datasets.distributed import split_dataset_by_node

        stream = self._open()
        n_files = stream.n_shards
        if n_files % num_shards and num_shards > 1 and not self._warned:
            self._warned = True
            logger.warning(
                f"data: {self.name} has {n_files} data files, not a multiple of the {num_shards} virtual shards: "
                "each virtual shard stream reads the whole stream and keeps every "
                f"{num_shards}th record (set training.dataset_virtual_shards to a divisor of {n_files})"
            )
        part = split_dataset_by_node(stream, rank=shard, world_size=num_shards)
        return HFShardDocuments(part, self.text_field, start, position, self.name)

    def __getstate__(self) -> dict:
        """Picklable for spawned dataloader workers: each process opens the stream itself."""
        return {**self.__dict__, "_stream": None}


class HFShardDocuments:
    """One virtual shard's usable documents, with the stream position before the next one."""

    def __init__(self, part, text_field: str, start: int, position: dict | None, name: str) -> None:
        self._part, self._field = part, text_field
        if position is not None:
            try:
                part.load_state_dict(position)
            except Exception as e:  # a position from another dataset or datasets version
                raise DataError(f"dataset_path {name}: cannot resume the stream at {position}: {e}") from None
        self._rows = iter(part)
        for _ in range(0 if position is not None else start):  # no saved position: skip, as before
            if next(self, None) is None:
                break

    def __iter__(self) -> HFShardDocuments:
        return self

    def __next__(self) -> str:
        for row in self._rows:
            text, _ = record_text(row, self._field)
            if text is not None:
                return text
        raise StopIteration

    def position(self) -> dict:
        """Where the next document begins: `datasets`' state of this shard's stream (JSON-able)."""
        return self._part.state_dict()


def open_source(
    dataset_path: str, text_field: str, index_dir: str | None = None, report: bool = True, verify: bool = False
) -> DocumentSource:
    """The source for a dataset path (`DataSource.parse`): "" is the bundled corpus, `hf://...` a Hugging Face
    dataset, a folder the tokenize tool wrote its tokens (`token_shards.py`). `index_dir` and `report`:
    `LocalSource`'s; `index_dir` and `verify`: `TokenShards`'."""
    source = DataSource.parse(dataset_path)
    if isinstance(source, HFDataset):
        return HFSource(source, text_field)
    if is_token_folder(dataset_path):
        return TokenShards(dataset_path, index_dir, verify)
    path = dataset_path or str(BUNDLED_CORPUS)
    files = resolve_files(path)
    if dataset_path and report:  # the bundled corpus's README is expected
        warn_skipped_files(path)
    return LocalSource(files, text_field, name=path, index_dir=index_dir, report=report)
