"""Packed token samples from virtual shards: the same global batches for any data-parallel layout.

Document d belongs to virtual shard `d % V`; each shard is an independent stream that tokenizes its own
documents (BOS + text + EOS), concatenates them and cuts windows of `seq_len + 1` tokens, starting over
(epoch + 1) when it runs out. The layout only decides who reads which shard: data-parallel rank r owns
the shards v with `v % dp_degree == r`, and every optimizer step takes `global_batch_size // V` samples
from every shard, so the union over ranks of a step is the same for every dp degree and a shard's
position (`ShardCursor`) is all the state needed to continue it on any rank. Loader workers get whole
microbatches round-robin and produce exactly the samples one process would. A mixture's shard is one
such stream per source (`mixture.py`). The layout in full: docs/parallelism.md#data-and-the-data-parallel-degree.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
from torch.utils.data import IterableDataset, get_worker_info

from titanlite.data.batch import Batch
from titanlite.data.local_files import counted
from titanlite.data.mixture import MixedSources
from titanlite.data.sources import DocumentSource
from titanlite.data.tokenizer import Tokenizer
from titanlite.errors import CheckpointError, ConfigError, DataError

logger = logging.getLogger("titanlite")

STATE_VERSION = 1


def virtual_shard_count(virtual_shards: int, global_batch_size: int) -> int:
    """The virtual shards of a stream: as configured, or 0 = one per sample of the global batch (the
    finest split, so any data-parallel degree dividing the batch reads the same order)."""
    return virtual_shards or global_batch_size


@dataclass(frozen=True)
class ShardLayout:
    """Which virtual shards a data-parallel rank (and each of its workers) reads, per step."""

    global_batch_size: int
    local_batch_size: int
    num_shards: int
    dp_rank: int
    dp_degree: int

    @classmethod
    def create(
        cls,
        *,
        global_batch_size: int,
        local_batch_size: int,
        virtual_shards: int,
        dp_rank: int,
        dp_degree: int,
        num_workers: int = 0,
    ) -> ShardLayout:
        """Validated layout; `virtual_shards` 0 means one shard per sample of the global batch.

        `num_workers` is only checked: workers can split a rank's shards without changing its stream
        only when they serve whole microbatches made of whole shard contributions.
        """
        gbs, lbs, dp = global_batch_size, local_batch_size, dp_degree
        v = virtual_shard_count(virtual_shards, gbs)
        if min(gbs, lbs, v, dp) < 1 or not 0 <= dp_rank < dp or num_workers < 0:
            raise ConfigError(
                f"invalid data layout: global_batch_size {gbs}, local_batch_size {lbs}, virtual_shards {v}, "
                f"dp_rank {dp_rank} of {dp}, num_workers {num_workers}"
            )
        if gbs % v:
            raise ConfigError(f"training.global_batch_size {gbs} is not a multiple of the {v} virtual shards")
        if v % dp:
            raise ConfigError(f"the {v} virtual shards are not a multiple of the data-parallel degree {dp}")
        if gbs % (lbs * dp):
            raise ConfigError(
                f"training.global_batch_size {gbs} is not a multiple of local_batch_size {lbs} "
                f"x data-parallel degree {dp}"
            )
        layout = cls(gbs, lbs, v, dp_rank, dp)
        if num_workers and (layout.microbatches % num_workers or lbs % layout.samples_per_shard):
            raise ConfigError(
                f"training.dataloader_num_workers {num_workers} needs the {layout.microbatches} microbatches per "
                f"step to be a multiple of it, and local_batch_size {lbs} a multiple of the "
                f"{layout.samples_per_shard} samples per virtual shard and step (global batch / virtual shards): "
                "each worker makes whole microbatches; -1 picks a count that fits"
            )
        return layout

    @property
    def samples_per_shard(self) -> int:
        """k: samples each virtual shard contributes to one global batch."""
        return self.global_batch_size // self.num_shards

    @property
    def microbatches(self) -> int:
        """Microbatches of `local_batch_size` per rank and step (gradient accumulation steps)."""
        return self.global_batch_size // (self.local_batch_size * self.dp_degree)

    @property
    def rank_shards(self) -> list[int]:
        return list(range(self.dp_rank, self.num_shards, self.dp_degree))

    def worker_round(self, worker: int, num_workers: int, rank_pos: int) -> tuple[list[int], int]:
        """(shards in step order, position in that round) for a worker starting at `rank_pos`.

        `rank_pos` is the number of samples of the current step the rank has already produced. A
        fresh DataLoader iterator asks worker 0 for the next microbatch q = rank_pos / local_batch_size,
        worker 1 for q + 1, ...; with microbatches per step a multiple of num_workers, worker w then
        serves the microbatches m = q + w (mod num_workers) of every step.
        """
        shards = self.rank_shards
        if num_workers == 1:
            return shards, rank_pos
        if rank_pos % self.local_batch_size:
            raise CheckpointError(f"data loader position {rank_pos} is not at a microbatch boundary")
        q = rank_pos // self.local_batch_size
        per_microbatch = self.local_batch_size // self.samples_per_shard
        mine = [m for m in range(self.microbatches) if (m - q - worker) % num_workers == 0]
        round_shards = [s for m in mine for s in shards[m * per_microbatch : (m + 1) * per_microbatch]]
        done = sum(m < q for m in mine) * self.local_batch_size  # == the round's size: next step's turn
        return round_shards, done % (len(round_shards) * self.samples_per_shard)


@dataclass
class ShardCursor:
    """Where a shard stream is: token `offset` of its `doc`-th document (within the shard) in `epoch`;
    for a streamed source also `source`, the stream's position before that document (see sources.py)."""

    epoch: int = 0
    doc: int = 0
    offset: int = 0
    source: dict | None = None


def _cursor_state(cursor: ShardCursor) -> dict:
    """A cursor's fields; `source` only for streams (local data's states stay plain ints)."""
    state = asdict(cursor)
    if state["source"] is None:
        del state["source"]
    return state


def _shard_state(stream: ShardStream | MixedStream) -> dict:
    """A shard's saved state: its cursor, or a mixture's samples and cursor per source."""
    return stream.state() if isinstance(stream, MixedStream) else _cursor_state(stream.cursor)


def _sources(stream: ShardStream | MixedStream) -> list[tuple[str, ShardStream]]:
    """(label, stream) of each source a shard reads."""
    if isinstance(stream, MixedStream):
        return list(zip(stream.mixture.names, stream.streams))
    return [("", stream)]


class ShardStream:
    """One virtual shard: its documents, tokenized and packed, from a cursor."""

    label = ""
    """The source a log line names: none for a single dataset."""

    def __init__(
        self, shard: int, source: DocumentSource, tokenizer: Tokenizer, num_shards: int, cursor: ShardCursor
    ) -> None:
        self.shard = shard
        self.source = source
        self.tokenizer = tokenizer
        self.num_shards = num_shards
        self.cursor = cursor
        self._docs: Iterator[str] | None = None  # this pass's documents, positioned after `_tokens`' one
        self._tokens: list[int] | None = None
        self._pass_tokens: int | None = None  # tokens of this pass so far; None if it was not read from its start
        self.pass_documents = 0  # documents of the last finished pass (known once one has finished)

    def _current(self) -> list[int]:
        if self._tokens is None:
            c = self.cursor
            if self._docs is None:
                self._docs = self.source.shard_documents(self.shard, self.num_shards, c.doc, c.source)
                self._pass_tokens = 0 if c.doc == 0 else None
            text = next(self._docs, None)
            if text is None:  # end of this pass: start over
                if c.doc == 0:
                    raise DataError(
                        f"{self.source.name}: virtual shard {self.shard} has no documents; the data has fewer "
                        f"documents than the {self.num_shards} virtual shards (set training.dataset_virtual_shards)"
                    )
                if self._pass_tokens == 0:  # a whole pass without tokens (module docstring)
                    raise DataError(
                        f"{self.source.name}: a whole pass over virtual shard {self.shard} "
                        f"({counted(c.doc, 'document')}) gave no tokens: its documents are empty"
                    )
                self.pass_documents = c.doc
                c.epoch, c.doc, c.offset, c.source = c.epoch + 1, 0, 0, None
                self._docs = None
                return self._current()
            # Pre-tokenized data gives the tokens that encoding its text here would.
            self._tokens = text if isinstance(text, list) else self.tokenizer.encode(text, bos=True, eos=True)
            if self._pass_tokens is not None:
                self._pass_tokens += len(self._tokens)
        return self._tokens

    def __getstate__(self) -> dict:
        """Picklable (spawned workers): the document iterator is reopened from the cursor."""
        return {**self.__dict__, "_docs": None, "_tokens": None}

    def take(self, n: int) -> tuple[list[int], list[int]]:
        """The next `n` tokens, across document boundaries, and each one's position in its document (its
        offset in the tokenized document, so a cursor restores positions as exactly as tokens)."""
        out: list[int] = []
        positions: list[int] = []
        while len(out) < n:
            tokens = self._current()
            c = self.cursor
            piece = tokens[c.offset : c.offset + n - len(out)]
            out += piece
            positions += range(c.offset, c.offset + len(piece))
            c.offset += len(piece)
            if c.offset >= len(tokens):
                c.doc, c.offset = c.doc + 1, 0
                self._tokens = None
                position = getattr(self._docs, "position", None)
                if position is not None:  # a stream: where the next document begins
                    c.source = position()
        return out, positions


class MixedStream:
    """One virtual shard of a mixture (`mixture.py`): a stream per source, each sample from the source the
    mixture names for it; `n` counts the shard's samples. `label` and `cursor` are the last sample's source's."""

    def __init__(self, shard: int, sources: MixedSources, streams: list[ShardStream], n: int = 0) -> None:
        self.shard, self.mixture, self.streams, self.n = shard, sources.mixture, streams, n
        self._last = 0

    @property
    def label(self) -> str:
        return self.mixture.names[self._last]

    @property
    def cursor(self) -> ShardCursor:
        return self.streams[self._last].cursor

    @property
    def pass_documents(self) -> int:
        return self.streams[self._last].pass_documents

    def take(self, n: int) -> tuple[list[int], list[int]]:
        self._last = self.mixture.source_of(self.shard, self.n)
        self.n += 1
        return self.streams[self._last].take(n)

    def state(self) -> dict:
        return {
            "n": self.n,
            "sources": {name: _cursor_state(s.cursor) for name, s in zip(self.mixture.names, self.streams)},
        }


class PackedShards(IterableDataset):
    """Endless `Batch` samples (inputs, labels, positions) of one data-parallel rank, with a portable state.

    `state_dict()` = {"version", "V", "dp_rank", "dp_degree", "global_batch_size", "local_batch_size",
    "round_pos": samples already produced in the current step, "step": completed steps (None if a state
    saved without it was loaded), "shards": {str(v): ShardCursor fields ("source" for streams only)}}.
    `load_state_dict` takes the shards this rank owns from a state that may hold more (all ranks'
    merged), so the dp degree can change between runs at a step boundary.
    """

    def __init__(
        self,
        source: DocumentSource | MixedSources,
        tokenizer: Tokenizer,
        seq_len: int,
        layout: ShardLayout,
        log_epochs: bool = True,
    ) -> None:
        if seq_len < 1:
            raise ConfigError(f"training.seq_len must be positive, got {seq_len}")
        self.source = source
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.layout = layout
        self._round = layout.rank_shards  # the shards this process reads, in step order
        self._round_pos = 0  # samples produced in the current round (a worker's round: its share of a step)
        self._step: int | None = 0  # completed rounds, i.e. optimizer steps; None = unknown
        self._epochs_logged = log_epochs  # off for held-out data, which every evaluation reads from its start
        self._log_epochs = log_epochs
        self._streams = {v: self._stream(v, None) for v in self._round}
        self._epochs: dict[str, int] = {}  # per source (label), the newest epoch any of this process's shards is in
        self._start_samples = 0  # samples each shard had produced when this stream started (created or loaded)

    def _stream(self, shard: int, state: dict | None) -> ShardStream | MixedStream:
        """Shard `shard`'s stream from its saved state (None: from the start)."""
        state = state or {}
        if not isinstance(self.source, MixedSources):
            if "sources" in state:
                raise CheckpointError("data loader state is a mixture's (training.datasets); this run reads one")
            return ShardStream(shard, self.source, self.tokenizer, self.layout.num_shards, ShardCursor(**state))
        names = self.source.mixture.names
        saved = state.get("sources", {} if not state else None)
        if saved is None or (saved and sorted(saved) != sorted(names)):
            was = "one dataset" if saved is None else ", ".join(sorted(saved))
            raise CheckpointError(f"data loader state holds {was}; this run mixes {', '.join(names)}")
        streams = [
            ShardStream(shard, source, self.tokenizer, self.layout.num_shards, ShardCursor(**saved.get(name, {})))
            for name, source in zip(names, self.source.sources)
        ]
        return MixedStream(shard, self.source, streams, state.get("n", 0))

    def tokens_seen(self, steps: int) -> dict[str, int]:
        """For a mixture, the tokens each source has given the run (all data-parallel ranks) once `steps`
        optimizer steps past this stream's start (created or loaded) are done: the mixture's closed form
        (`mixture.Mixture.samples`) times `seq_len`; {} for a single dataset."""
        if not isinstance(self.source, MixedSources):
            return {}
        n = self._start_samples + steps * self.layout.samples_per_shard
        samples = self.source.mixture.samples(n)
        return {name: count * self.seq_len for name, count in samples.items()}

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        self._round, self._round_pos = self.layout.worker_round(worker, num_workers, self._round_pos)
        self._log_epochs = self._epochs_logged and worker == 0
        return self._samples()

    def _samples(self) -> Iterator[Batch]:
        k, window = self.layout.samples_per_shard, self.seq_len + 1
        while True:
            shard = self._round[self._round_pos // k]
            stream = self._streams[shard]
            tokens, positions = stream.take(window)
            if stream.cursor.epoch > self._epochs.get(stream.label, 0):
                self._new_epoch(shard)
            self._round_pos = (self._round_pos + 1) % (len(self._round) * k)  # state first: it is read after yield
            if self._round_pos == 0 and self._step is not None:
                self._step += 1
            sample = torch.tensor(tokens, dtype=torch.long)
            yield Batch(sample[:-1], sample[1:], torch.tensor(positions[:-1], dtype=torch.long))

    def _new_epoch(self, shard: int) -> None:
        stream = self._streams[shard]
        epoch = self._epochs[stream.label] = stream.cursor.epoch
        if not self._log_epochs:
            return
        if self._step is not None:
            when = f"at step {self._step + 1}"
        else:  # resumed from a state that did not count steps
            when = f"after {counted(stream.pass_documents, 'document')} of virtual shard {shard}"
        source = f"{stream.label}: " if stream.label else ""
        logger.info(f"data: {source}epoch {epoch + 1} begins {when}")

    def state_dict(self) -> dict:
        layout = self.layout
        return {
            "version": STATE_VERSION,
            "V": layout.num_shards,
            "dp_rank": layout.dp_rank,
            "dp_degree": layout.dp_degree,
            "global_batch_size": layout.global_batch_size,
            "local_batch_size": layout.local_batch_size,
            "round_pos": self._round_pos,
            "step": self._step,
            "shards": {str(v): _shard_state(self._streams[v]) for v in self._round},
        }

    def load_state_dict(self, state: dict) -> None:
        layout = self.layout
        if state.get("version") != STATE_VERSION or state.get("V") != layout.num_shards:
            raise CheckpointError(
                f"data loader state has {state.get('V')} virtual shards (version {state.get('version')}), this run "
                f"{layout.num_shards}: the number of virtual shards cannot change when resuming"
            )
        if state["round_pos"]:
            same = ("dp_rank", "dp_degree", "global_batch_size", "local_batch_size")
            if any(state.get(key) != getattr(layout, key) for key in same):
                raise CheckpointError(
                    "data loader state was saved in the middle of a step; it can only resume with the same "
                    "dp rank, dp degree and batch sizes"
                )
        missing = [v for v in layout.rank_shards if str(v) not in state["shards"]]
        if missing:
            raise CheckpointError(f"data loader state lacks virtual shards {missing} of dp rank {layout.dp_rank}")
        self._round = layout.rank_shards
        self._round_pos = state["round_pos"]
        self._step = state.get("step")
        self._streams = {v: self._stream(v, state["shards"][str(v)]) for v in self._round}
        self._epochs = {}
        for stream in self._streams.values():
            for label, sub in _sources(stream):
                self._epochs[label] = max(self._epochs.get(label, 0), sub.cursor.epoch)
        self._start_samples = min(s.n if isinstance(s, MixedStream) else 0 for s in self._streams.values())
