"""Fingerprints of a run's inputs that a checkpoint depends on: the dataset and the tokenizer.

A checkpoint records them (`complete.json`) so that a resume tells a different dataset or tokenizer from the
same one moved elsewhere: the loader's positions are offsets into one list of documents, and token ids mean
something only under one vocabulary. A dataset is its files' paths relative to its root, sizes and content
digests (computed while indexing, `data/index.py`) plus the text field, independent of location and mtimes;
an `hf://` dataset is its name, config and split; a mixture adds each source's name and weight and the seed.
The tokenizer is a hash of its files (`tokenizer_files`). Older checkpoints without `method` hashed each
file's first and last 64 KiB, and a resume from one compares the same way (`edge_fingerprint`).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from titanlite.data.data_source import DataSource
from titanlite.data.local_files import resolve_files
from titanlite.data.local_source import LocalSource
from titanlite.data.mixture import MixedSources
from titanlite.data.sources import BUNDLED_CORPUS, DocumentSource
from titanlite.data.token_shards import TokenShards
from titanlite.data.tokenizer import tokenizer_digest

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
    if not isinstance(source, (LocalSource, TokenShards)):
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


def mixture_fingerprint(mixed: MixedSources, text_field: str, seed: int) -> dict:
    """A mixture's fingerprint: `dataset_fingerprint`'s keys over all its sources, plus "sources" (each
    source's fingerprint with its "source" name and "weight") and the "seed" that interleaves them."""
    mixture = mixed.mixture
    parts = [
        {**dataset_fingerprint(source, text_field), "source": name, "weight": weight}
        for name, weight, source in zip(mixture.names, mixture.weights, mixed.sources)
    ]
    digest = hashlib.blake2b(f"seed={seed}\n".encode(), digest_size=8)
    for part in parts:
        digest.update(f"{part['source']}\0{part['weight']!r}\0{part['digest']}\0".encode())
    return {
        "name": mixed.name,
        "text_field": text_field,
        "files": sum(p["files"] for p in parts),
        "bytes": sum(p["bytes"] for p in parts),
        "digest": digest.hexdigest(),
        "method": "content",
        "sources": parts,
        "seed": seed,
    }


def describe_mixture_change(was: dict, now: dict) -> str:
    """What changed between two dataset fingerprints of which at least one is a mixture's, in words: the
    first source added, removed, reweighted or with other data, or the seed."""
    if "sources" not in was:
        return f"training.dataset_path was {describe_dataset(was)}, this run reads the mixture {now['name']}"
    if "sources" not in now:
        return f"training.datasets was the mixture {was['name']}, this run reads {describe_dataset(now)}"
    old = {p["source"]: p for p in was["sources"]}
    new = {p["source"]: p for p in now["sources"]}
    for name in (name for name in old if name not in new):  # list order: the same source every run
        return f"training.datasets source {name!r} was removed (mixture {was['name']} -> {now['name']})"
    for name in (name for name in new if name not in old):
        return f"training.datasets source {name!r} was added (mixture {was['name']} -> {now['name']})"
    for name, part in new.items():
        if old[name]["weight"] != part["weight"]:
            return f"training.datasets source {name!r} had weight {old[name]['weight']:g}, this run {part['weight']:g}"
        if old[name]["digest"] != part["digest"]:
            return (
                f"training.datasets source {name!r} was {describe_dataset(old[name])}, this run reads "
                f"{describe_dataset(part)}"
            )
    if [p["source"] for p in was["sources"]] != [p["source"] for p in now["sources"]]:
        return f"training.datasets lists its sources in another order ({was['name']} -> {now['name']})"
    return f"training.seed was {was['seed']}, this run has {now['seed']} (it interleaves the mixture)"


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
    return {"name": str(tokenizer_path or "bundled"), "digest": tokenizer_digest(tokenizer_path)}


def describe_dataset(fp: dict) -> str:
    if not fp["files"]:
        return f"{fp['name']} (digest {fp['digest']})"
    return f"{fp['name']} ({fp['files']} files, {fp['bytes']:,} bytes, digest {fp['digest']})"
