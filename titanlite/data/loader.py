"""The training data loader: `build_dataloader` and its portable, reshardable state.

`build_dataloader(...)` returns a `TokenLoader`, a torchdata `StatefulDataLoader` over `PackedShards`
(`dataset.py`), yielding `Batch(inputs, labels, positions)` (`batch.py`) of `[local_batch_size, seq_len]`.
`loader.state_dict()` is the dataset's portable state (virtual shards, dp rank and degree, batch sizes,
the position within the step, each shard's cursor), not StatefulDataLoader's wrapper, which is specific
to one worker count: plain ints, strings and dicts, so it pickles and JSON-encodes. Loaded with the same
configuration it continues with exactly the next batch; states taken at a step boundary merge
(`merge_loader_states`) to resume on another dp degree. Workers start from multiprocessing's fork server,
never forked from the rank (`workers.py`). The state and the resharding rule: docs/parallelism.md.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator, Sequence

from torchdata.stateful_dataloader import StatefulDataLoader

from titanlite.config import DatasetSource
from titanlite.data.batch import Batch, collate
from titanlite.data.dataset import STATE_VERSION, PackedShards, ShardLayout
from titanlite.data.local_files import counted
from titanlite.data.local_source import LocalSource
from titanlite.data.mixture import MixedSources, Mixture
from titanlite.data.sources import DocumentSource, open_source
from titanlite.data.token_shards import TokenShards
from titanlite.data.tokenizer import Tokenizer, tokenizer_digest
from titanlite.data.workers import WorkerSetup, worker_context
from titanlite.errors import CheckpointError, DataError

logger = logging.getLogger("titanlite")


class TokenLoader(StatefulDataLoader):
    """A StatefulDataLoader whose `state_dict()` is the portable dataset state (module docstring)."""

    dataset: PackedShards

    def state_dict(self) -> dict:
        if self.num_workers == 0 or self._iterator is None:
            return self.dataset.state_dict()  # single process: the dataset is the live state
        # Workers: StatefulDataLoader keeps each worker's dataset state as of its last *consumed*
        # batch. Each shard belongs to one worker; the step position follows from the batch count.
        native = super().state_dict()
        snapshot = native["_snapshot"]
        state = self.dataset.state_dict()  # as when the workers started
        for worker in snapshot["_worker_snapshots"].values():
            state["shards"].update(worker["dataset_state"]["shards"])
        layout = self.dataset.layout
        yielded = snapshot["_snapshot_step"] + native["_steps_since_snapshot"]
        batches = state["round_pos"] // layout.local_batch_size + yielded  # since the start of the step
        if state["step"] is not None:
            state["step"] += batches // layout.microbatches
        state["round_pos"] = batches % layout.microbatches * layout.local_batch_size
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict({})  # drop any iterator; the next one starts from the dataset's state
        self.dataset.load_state_dict(state)

    def __iter__(self) -> Iterator[Batch]:
        if self.num_workers and self._iterator is not None and not self._initial_iter_for_state_dict:
            # New workers would start from the state they were first given: move it forward first.
            self.load_state_dict(self.state_dict())
        return super().__iter__()


def merge_loader_states(states: list[dict]) -> dict:
    """One state holding every virtual shard, from the step-boundary states of all old dp ranks.

    Duplicates (e.g. the tensor-parallel ranks of one dp rank) must agree. The result loads into
    any rank of any dp degree that divides V.
    """
    if not states:
        raise CheckpointError("no data loader states to merge")
    num_shards = states[0].get("V")
    shards: dict[str, dict] = {}
    for state in states:
        if state.get("version") != STATE_VERSION or state.get("V") != num_shards:
            raise CheckpointError("data loader states disagree on the number of virtual shards")
        if state["round_pos"]:
            raise CheckpointError(
                f"data loader state of dp rank {state['dp_rank']} is {state['round_pos']} samples into a step; "
                "states can only be merged at a step boundary"
            )
        for key, cursor in state["shards"].items():
            if shards.setdefault(key, cursor) != cursor:
                raise CheckpointError(f"data loader states disagree on the position of virtual shard {key}")
    if len(shards) != num_shards:
        raise CheckpointError(f"data loader states cover {len(shards)} of {num_shards} virtual shards")
    first = states[0]
    return {
        **first,
        "dp_rank": 0,
        "dp_degree": 1,
        "round_pos": 0,
        "shards": {str(v): shards[str(v)] for v in range(num_shards)},
    }


def _checked_source(
    dataset_path: str,
    tokenizer: Tokenizer,
    text_field: str,
    layout: ShardLayout,
    index_dir: str | None,
    report: bool,
    holdout_documents: int,
    heldout: bool,
    verify: bool,
) -> DocumentSource:
    """One dataset, opened and checked up front (it fills every virtual shard; pre-tokenized, it was made by
    `tokenizer`); its line logged."""
    source = open_source(dataset_path, text_field, index_dir=index_dir, report=report, verify=verify)
    if isinstance(source, TokenShards):
        source.check_tokenizer(tokenizer_digest(tokenizer.path), tokenizer.path)
    what = "held-out document" if heldout else "document"
    if holdout_documents:
        if not isinstance(source, (LocalSource, TokenShards)):
            raise DataError(f"dataset_path {source.name}: documents can be held out of local data only")
        n = source.num_documents
        if holdout_documents >= n:
            raise DataError(
                f"dataset_path {source.name}: validation.holdout_documents {holdout_documents} leaves none of its "
                f"{counted(n, 'document')} to train on"
            )
        source = source.part(n - holdout_documents, n) if heldout else source.part(0, n - holdout_documents)
    if isinstance(source, (LocalSource, TokenShards)):
        n = source.num_documents
        if n == 0:
            raise DataError(f"dataset_path {source.name}: no usable documents in {counted(len(source.files), 'file')}")
        if n < layout.num_shards:
            hint = (
                "validation.local_batch_size x dp (each sample of a batch is one stream); hold out more or lower it"
                if heldout
                else "set training.dataset_virtual_shards lower"
            )
            raise DataError(
                f"dataset_path {source.name}: {counted(n, what)}, fewer than the {layout.num_shards} virtual shards "
                f"({hint})"
            )
        logger.info(f"data: {counted(n, what)} in {counted(len(source.files), 'file')} from {source.name}")
    elif next(source.shard_documents(0, 1, 0), None) is None:
        raise DataError(f"dataset_path {source.name}: no usable documents")
    return source


def build_dataloader(
    *,
    tokenizer: Tokenizer,
    dataset_path: str,
    text_field: str,
    seq_len: int,
    local_batch_size: int,
    global_batch_size: int,
    dp_rank: int,
    dp_degree: int,
    virtual_shards: int = 0,
    num_workers: int = 0,
    pin_memory: bool = False,
    holdout_documents: int = 0,
    heldout: bool = False,
    index_dir: str | None = None,
    report: bool = True,
    verify: bool = False,
    log_epochs: bool = True,
    mixture: Sequence[DatasetSource] = (),
    seed: int = 0,
) -> TokenLoader:
    """The loader of dp rank `dp_rank`; bad paths and unusable data raise `DataError` here, up front.

    `pin_memory` (CUDA) yields batches in page-locked memory, so the step copies them to the GPU
    without blocking the host. `holdout_documents` > 0 sets the last N documents of local data apart:
    the loader reads the documents before them, or with `heldout` only them (validation). `index_dir`
    keeps the local files' indexes (`index.py`) and the record of the pre-tokenized shards verified
    (`verified_shards.py`); `report` prints the data's warnings (one process of a launch does); `verify`
    reads every pre-tokenized shard not recorded as verified as it is now (the preflight does; the ranks
    trust its record); `log_epochs` logs each new pass over the data (`data: epoch E begins at step N`).
    `mixture` (named, weighted sources; `dataset_path` and the held-out documents then unused) reads a
    weighted mixture interleaved from `seed` (`mixture.py`)."""
    layout = ShardLayout.create(
        global_batch_size=global_batch_size,
        local_batch_size=local_batch_size,
        virtual_shards=virtual_shards,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        num_workers=num_workers,
    )
    if mixture:
        opened = []
        for entry in mixture:
            try:
                opened.append(
                    _checked_source(entry.path, tokenizer, text_field, layout, index_dir, report, 0, False, verify)
                )
            except DataError as e:  # "dataset_path X: why" -> "datasets source NAME: X: why"
                raise DataError(f"datasets source {entry.name!r}:{str(e).removeprefix('dataset_path')}") from None
        names, weights = [entry.name for entry in mixture], [entry.weight for entry in mixture]
        source: DocumentSource | MixedSources = MixedSources(opened, Mixture(names, weights, seed, layout.num_shards))
        logger.info(f"data: mixture {source.name}")
    else:
        source = _checked_source(
            dataset_path, tokenizer, text_field, layout, index_dir, report, holdout_documents, heldout, verify
        )
    dataset = PackedShards(source, tokenizer, seq_len, layout, log_epochs=log_epochs)
    with warnings.catch_warnings():  # torchdata 0.11 calls a torch API deprecated in torch 2.13
        warnings.filterwarnings("ignore", message=".*set_vital.* is deprecated")
        workers = {}  # (torch refuses a start method for a loader without workers)
        if num_workers:
            workers = dict(multiprocessing_context=worker_context(), worker_init_fn=WorkerSetup.here(logger))
        return TokenLoader(
            dataset,
            batch_size=local_batch_size,
            num_workers=num_workers,
            collate_fn=collate,
            pin_memory=pin_memory,
            **workers,
        )
