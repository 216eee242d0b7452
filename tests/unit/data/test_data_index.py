"""The data index folder a run's processes share (`data/index.py`, `data/verified_shards.py`): what is missing
there (a text file's document index, the record of a token folder's verified shards) is built by one of the
processes that need it while the others wait and then read it, and a text source's document offsets are
mapped from it, not pickled into each loader worker."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import time
from pathlib import Path

import pytest

from titanlite.data import local_source, verified_shards
from titanlite.data.loader import build_dataloader
from titanlite.data.sources import open_source
from titanlite.data.tokenizer import build_tokenizer
from titanlite.tools.tokenize import tokenize_source

SLOW_READ_S = 0.5
"""How long each read the race watches takes: the other process asks for the entry meanwhile."""


def _open_after(barrier, path: str, index_dir: str, results) -> None:
    barrier.wait()
    source = open_source(path, "text", index_dir=index_dir)
    results.put((source.num_documents, source.digests))


@pytest.mark.parametrize("kind", ["text", "tokens"])
def test_a_cold_entry_is_built_by_one_of_two_racing_processes_while_the_other_waits(tmp_path, monkeypatch, kind):
    """Two processes open the same data with a cold data index at once (the preflights of two nodes): the text
    file is scanned, or the shards read for their digests, by one of them only, and both get the same source."""
    text = tmp_path / "docs.txt"
    text.write_text("".join(f"document {i} of the race\n\n" for i in range(40)))
    path, reads = str(text), 1
    target, name = local_source.LocalSource, "_index"
    if kind == "tokens":
        tokenize_source(str(text), "text", "", tmp_path / "tokens", workers=1, per_shard=20)
        path, reads = str(tmp_path / "tokens"), 2
        target, name = verified_shards, "_read"
    log = tmp_path / "reads.log"
    real = getattr(target, name)

    def slow(*args):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(SLOW_READ_S)
        return real(*args)

    monkeypatch.setattr(target, name, slow)
    context = multiprocessing.get_context("fork")  # the patched read goes with it
    barrier, results = context.Barrier(2), context.Queue()
    racers = [
        context.Process(target=_open_after, args=(barrier, path, str(tmp_path / "index"), results)) for _ in range(2)
    ]
    for racer in racers:
        racer.start()
    got = [results.get(timeout=60) for _ in racers]
    for racer in racers:
        racer.join(timeout=60)
    assert [racer.exitcode for racer in racers] == [0, 0]
    readers = log.read_text().split()
    assert len(readers) == reads and len(set(readers)) == 1, readers
    assert got[0] == got[1] and got[0][0] == 40


def test_a_loader_worker_gets_where_the_document_offsets_are_not_a_copy(tmp_path):
    """Pickled (as into a loader worker), a text source indexed in an index folder is a few kilobytes whatever
    its document count (a copy of its offsets and lengths is 16 bytes a document: 3.2 MB here), and the copy
    reads the same documents from the mapped index."""
    n = 200_000
    text = tmp_path / "docs.txt"
    text.write_text("".join(f"document {i}\n\n" for i in range(n)))
    dataset = build_dataloader(
        tokenizer=build_tokenizer(None),
        dataset_path=str(text),
        text_field="text",
        seq_len=32,
        local_batch_size=4,
        global_batch_size=8,
        dp_rank=0,
        dp_degree=1,
        index_dir=str(tmp_path / "index"),
    ).dataset
    size = len(pickle.dumps(dataset))  # what a worker of its loader receives
    assert size < 64_000, size
    source = dataset.source
    copy = pickle.loads(pickle.dumps(source))
    ids = [0, 1, n // 2, n - 1]
    assert list(copy.documents(ids)) == list(source.documents(ids)) == [f"document {i}" for i in ids]
    assert Path(copy._spans[0]._stored[0]).parent == tmp_path / "index"
