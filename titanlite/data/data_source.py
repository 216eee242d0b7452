"""What a dataset path names, decided once: the kind of source (`DataSource.parse`) that the loader opens,
the fingerprint identifies, and the run plan's rules ask about (held-out documents need local files).

    ""                             the bundled corpus             LocalFiles("")
    a file, folder or glob         local text/JSON/parquet files  LocalFiles(path)
    hf://name[:config][@split]     a streamed Hugging Face set    HFDataset(name, config, split)
"""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.errors import DataError

HF_PREFIX = "hf://"


@dataclass(frozen=True)
class DataSource:
    """A parsed `dataset_path`; `path` is the text as configured (the name logs and fingerprints use)."""

    path: str

    local = True
    """The documents are files here: they can be counted, held out and fingerprinted by content."""

    @staticmethod
    def parse(path: str) -> DataSource:
        """The kind `path` names; a malformed `hf://` path is one line (`DataError`)."""
        if path.startswith(HF_PREFIX):
            return HFDataset.of(path)
        return LocalFiles(path)


@dataclass(frozen=True)
class LocalFiles(DataSource):
    """Files on this machine (`data/local_files.py` resolves them); an empty path is the bundled corpus."""

    @property
    def bundled(self) -> bool:
        return not self.path


@dataclass(frozen=True)
class HFDataset(DataSource):
    """A Hugging Face dataset, streamed with `datasets`; the split defaults to train."""

    name: str = ""
    config: str | None = None
    split: str = "train"

    local = False

    @classmethod
    def of(cls, path: str) -> HFDataset:
        rest, _, split = path.removeprefix(HF_PREFIX).partition("@")
        name, _, config = rest.partition(":")
        if not name:
            raise DataError(f"dataset_path {path!r}: expected hf://name[:config][@split]")
        return cls(path, name, config or None, split or "train")
