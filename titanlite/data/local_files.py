"""The local files a dataset path names, and what each holds by its suffix.

A local dataset path is a file, a folder (read recursively) or a glob; the files it names are read in
the order of their paths, so document numbers, hence virtual shards, do not depend on the file system's
listing order. A file's suffix, in any case, says what it holds (`.txt` paragraphs, `.jsonl`/`.json`
records, `.parquet` rows) and its compression (none, `.gz`, `.zst`); other files are skipped with one
warning per suffix, so a stray file in a data folder is visible without stopping the run.
"""

from __future__ import annotations

import glob
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Literal

from titanlite.errors import DataError

logger = logging.getLogger("titanlite")

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
