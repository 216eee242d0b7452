"""Document sources: where text comes from, in one deterministic global order.

A source enumerates documents (non-empty strings) in a fixed global order, so document `d` always lands
in virtual shard `d % V` (`dataset.py`) whatever the data-parallel layout, and serves one shard's
documents (`shard`, `shard + V`, ...) from any ordinal: all a shard stream needs to start, resume or
begin an epoch. `open_source` picks the source a dataset path names: local files (`local_source.py`:
`.txt`, `.jsonl`/`.json`, each plain, `.gz` or `.zst`, and `.parquet`, indexed once), a Hugging Face
dataset (`hf_source.py`, `hf://name[:config][@split]`), or a folder of tokens the tokenize tool wrote
(`token_shards.py`). The formats and the splits: docs/configuration.md#data.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from titanlite.data.data_source import DataSource, HFDataset
from titanlite.data.hf_source import HFSource
from titanlite.data.local_files import resolve_files, warn_skipped_files
from titanlite.data.local_source import LocalSource
from titanlite.data.token_shards import TokenShards, is_token_folder

BUNDLED_CORPUS = Path(__file__).resolve().parent / "corpus"


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
