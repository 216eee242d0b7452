"""Fingerprints of a run's inputs that a checkpoint depends on: the dataset and the tokenizer.

A checkpoint records them (`complete.json`) so that a resume can tell a different dataset or tokenizer
from the same one moved elsewhere: the data loader's saved positions are offsets into one list of
documents, and token ids mean something only under one vocabulary.

Dataset: the supported files that `training.dataset_path` names (the bundled corpus for ""), each
identified by its path relative to the dataset's root, its size and the digest of its whole content
that indexing it computed (`data/index.py`: every byte is hashed during the scan that indexing does
anyway, and kept with the index while the file's size and modification time are unchanged), plus the
text field. Independent of where the files live or their modification times, which a copy or a fresh
checkout changes. An `hf://` dataset is identified by its name, config and split. Tokenizer: a hash of
its whole files (`data/tokenizer.py`'s `tokenizer_files`: a few MB at most).

Checkpoints written before content digests (no `method` in their fingerprint) hashed each file's first
and last 64 KiB: a resume from one compares the same way (`edge_fingerprint`).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from titanlite.data.data_source import DataSource
from titanlite.data.sources import BUNDLED_CORPUS, DocumentSource, LocalSource, resolve_files
from titanlite.data.tokenizer import tokenizer_files

_EDGE = 64 << 10


def _edges(path: Path, size: int) -> bytes:
    """The first and last 64 KiB of a file (all of it when smaller)."""
    with open(path, "rb") as f:
        head = f.read(_EDGE)
        if size <= 2 * _EDGE:
            return head + f.read()
        f.seek(size - _EDGE)
        return head + f.read(_EDGE)


def _start(text_field: str, holdout_documents: int):
    digest = hashlib.blake2b(digest_size=8)
    digest.update(f"text_field={text_field}\n".encode())
    if holdout_documents:
        digest.update(f"holdout_documents={holdout_documents}\n".encode())
    return digest


def dataset_fingerprint(source: DocumentSource, text_field: str, holdout_documents: int = 0) -> dict:
    """{"name", "text_field", "files", "bytes", "digest", "method"} of the dataset a run reads (module
    docstring), from its source's index.

    Documents held out for validation are not trained on, so their count is part of the digest (when
    non-zero, so fingerprints of runs without a hold-out stay what they were)."""
    digest = _start(text_field, holdout_documents)
    if not isinstance(source, LocalSource):
        digest.update(source.name.encode())
        return {"name": source.name, "text_field": text_field, "files": 0, "bytes": 0, "digest": digest.hexdigest()}
    root = os.path.commonpath([str(f.parent) for f in source.files])
    total = 0
    for path, content in zip(source.files, source.digests):
        size = path.stat().st_size
        total += size
        digest.update(f"{os.path.relpath(path, root)}\0{size}\0{content}\0".encode())
    return {
        "name": source.name,
        "text_field": text_field,
        "files": len(source.files),
        "bytes": total,
        "digest": digest.hexdigest(),
        "method": "content",
    }


def edge_fingerprint(dataset_path: str, text_field: str, holdout_documents: int = 0) -> dict:
    """The fingerprint as checkpoints without `method` recorded it: each file's first and last 64 KiB."""
    digest = _start(text_field, holdout_documents)
    if not DataSource.parse(dataset_path).local:
        digest.update(dataset_path.encode())
        return {"name": dataset_path, "text_field": text_field, "files": 0, "bytes": 0, "digest": digest.hexdigest()}
    name = dataset_path or str(BUNDLED_CORPUS)
    files = resolve_files(name)
    root = os.path.commonpath([str(f.parent) for f in files])
    total = 0
    for path in files:
        size = path.stat().st_size
        total += size
        digest.update(f"{os.path.relpath(path, root)}\0{size}\0".encode())
        digest.update(hashlib.blake2b(_edges(path, size), digest_size=16).digest())
    return {"name": name, "text_field": text_field, "files": len(files), "bytes": total, "digest": digest.hexdigest()}


def tokenizer_fingerprint(tokenizer_path: str) -> dict:
    """{"name", "digest"} of the tokenizer's files (`model.tokenizer_path`, "" = the bundled one): the
    content of a one-file tokenizer (a tiktoken file, a lone `tokenizer.json`); each file's size and content
    in order where there are more (a `tokenizer.json` with its `tokenizer_config.json`, which names BOS and EOS)."""
    files = tokenizer_files(tokenizer_path)
    if len(files) == 1:
        digest = hashlib.blake2b(files[0].read_bytes(), digest_size=8)
    else:
        digest = hashlib.blake2b(digest_size=8)
        for path in files:
            digest.update(f"{path.stat().st_size}\0".encode())
            digest.update(path.read_bytes())
    return {"name": str(tokenizer_path or "bundled"), "digest": digest.hexdigest()}


def describe_dataset(fp: dict) -> str:
    if not fp["files"]:
        return f"{fp['name']} (digest {fp['digest']})"
    return f"{fp['name']} ({fp['files']} files, {fp['bytes']:,} bytes, digest {fp['digest']})"
