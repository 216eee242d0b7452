"""HFSource: a Hugging Face dataset streamed with `datasets` as a document source.

`hf://name[:config][@split]` (split defaults to train) is opened once per process and streamed, never
downloaded whole; virtual shard v is `split_dataset_by_node(stream, rank=v, world_size=V)`, so the
documents a shard reads do not depend on the data-parallel layout. A stream has no document count
before its end; a shard resumes from the stream position its iterator reported (`datasets`' state),
not by skipping documents again. Rows without usable text are skipped as JSON records are
(`file_scan.record_text`).
"""

from __future__ import annotations

import logging

from titanlite.data.data_source import HFDataset
from titanlite.data.file_scan import record_text
from titanlite.errors import DataError

logger = logging.getLogger("titanlite")


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
