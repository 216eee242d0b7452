"""Scanning a local data file into its documents: byte offsets, a content digest, what was wrong.

A `.txt` file's documents are its paragraphs (lines up to a blank one), a JSON Lines file's its records
with a non-empty string text field, a parquet file's its rows with usable text. The scan reads every
byte once, in chunks, and feeds the digest as it goes; records that cannot be used (invalid JSON,
undecodable paragraphs, a missing field) are counted and the file's notes say how many, and a file that
breaks partway keeps the documents before the damage. The result is cached by `index.py`, so a file is
scanned once per content, not once per process.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from titanlite.data import file_streams, index
from titanlite.data.local_files import Compression, Kind, counted

_BOM = b"\xef\xbb\xbf"  # UTF-8 byte-order mark, as some editors start .txt files
_BINARY_SNIFF = 8192  # like git: a NUL byte in the first 8 KiB means a binary file
_PARAGRAPH = re.compile(rb"(?:^[ \t\r\x0b\x0c]*[^\s][^\n]*(?:\n|\Z))+", re.MULTILINE)
"""A paragraph: consecutive lines with a non-whitespace byte (`bytes.strip`'s whitespace is `\\s`)."""
_SCAN_CHUNK = 64 << 10


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


def scan_file(path: Path, kind: Kind, compression: Compression, text_field: str) -> index.FileIndex:
    """Scan one file: its documents, a digest of its content and what was wrong with it."""
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
                while chunk := f.read(_SCAN_CHUNK):
                    digest.update(chunk)
            column = file_streams.read_parquet_column(path, text_field)
            spans = [(row, 0) for row, text in enumerate(column) if text is not None]
            issues["rows without usable text"] = len(column) - len(spans)
        else:
            with file_streams.open_stream(path, compression) as f:
                head = f.read(_BINARY_SNIFF)
            if b"\0" in head:
                digest.update(head)
                found.digest = digest.hexdigest()
                found.notes.append(f"data: skipped {path}: binary file")
                return found
            with file_streams.open_stream(path, compression) as f:
                pos = len(_BOM) if head.startswith(_BOM) else 0
                digest.update(f.read(pos))
                scan = _scan_txt if kind == "txt" else _scan_jsonl
                scan(f, pos, text_field, issues, spans, digest)
    except file_streams.read_errors() as e:  # unreadable, corrupt or truncated gzip/zstd/parquet
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
