"""The data loader: layout-invariant global batches, exact and reshardable resume, robust reading."""

import contextlib
import gzip
import io
import json
import logging
import os
import pickle
import random
import signal
import sys
from collections import Counter
from itertools import islice
from pathlib import Path

import pytest
import torch
from builders import loader

from titanlite.data.loader import merge_loader_states
from titanlite.data.sources import open_source
from titanlite.data.tokenizer import build_tokenizer
from titanlite.errors import CheckpointError, ConfigError, DataError

SEQ = 32
TOK = build_tokenizer(None)
WORDS = "the data loader packs documents into windows of tokens for every shard and rank".split()


def make_docs(n: int, seed: int = 0) -> list[str]:
    """Distinct documents from a few words to several windows long."""
    rng = random.Random(seed)
    return [f"Document {i}: " + " ".join(rng.choices(WORDS, k=rng.randint(3, 90))) for i in range(n)]


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def write_txt(path: Path, docs: list[str]) -> Path:
    path.write_text("\n\n".join(docs) + "\n")
    return path


def windows(batch) -> list[tuple[int, ...]]:
    """Each sample as its full window of seq_len + 1 tokens; its positions restart at each BOS and count
    up by one elsewhere (their values at the window's start are checked by `take`'s comparisons)."""
    inputs, labels, positions = batch
    assert inputs.shape == labels.shape == positions.shape and inputs.dtype == positions.dtype == torch.long
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    assert torch.equal(positions == 0, inputs == TOK.bos_id)
    continued = inputs[:, 1:] != TOK.bos_id
    assert torch.equal(positions[:, 1:][continued], positions[:, :-1][continued] + 1)
    return [tuple(row) + (last,) for row, last in zip(inputs.tolist(), labels[:, -1].tolist())]


def take(it, n: int) -> list[tuple[int, ...]]:
    """`n` batches' samples, each its token window followed by its positions: layouts and resumes compare
    both."""
    out = []
    for _ in range(n):
        batch = next(it)
        out += [w + tuple(p) for w, p in zip(windows(batch), batch.positions.tolist())]
    return out


def global_steps(loaders, n_steps: int, accum: int) -> list[list[tuple[int, ...]]]:
    """Per step, the sorted samples of all ranks (one loader per rank)."""
    iters = [iter(dl) for dl in loaders]
    return [sorted(s for it in iters for s in take(it, accum)) for _ in range(n_steps)]


def ranks(path, dp: int, **kw):
    return [loader(path, rank=r, dp=dp, **kw) for r in range(dp)]


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return make_docs(60)


@pytest.fixture
def data(tmp_path, docs) -> Path:
    return write_jsonl(tmp_path / "data.jsonl", docs)


@pytest.mark.parametrize("lbs", [1, 2])
def test_global_batches_do_not_depend_on_dp_degree(data, lbs):
    gbs, n_steps = 8, 25  # ~2 epochs of the data: shards also wrap around
    reference = global_steps(ranks(data, 1, gbs=gbs, lbs=lbs), n_steps, gbs // lbs)
    assert all(len(set(step)) == gbs for step in reference)  # no sample twice in a step
    for dp in (2, 4):
        assert global_steps(ranks(data, dp, gbs=gbs, lbs=lbs), n_steps, gbs // (lbs * dp)) == reference
    assert global_steps(ranks(data, 2, gbs=gbs, lbs=lbs, shards=4), n_steps, gbs // (lbs * 2)) != reference


def test_ranks_read_disjoint_shards(data):
    loaders = ranks(data, 4, gbs=8)
    owned = [set(dl.state_dict()["shards"]) for dl in loaders]
    assert owned == [{"0", "4"}, {"1", "5"}, {"2", "6"}, {"3", "7"}]


def test_a_rank_tokenizes_only_its_own_documents(data, docs):
    class SpyTokenizer:
        def __init__(self):
            self.seen = []

        def encode(self, text, *, bos, eos):
            self.seen.append(text)
            return TOK.encode(text, bos=bos, eos=eos)

    spy = SpyTokenizer()
    dl = loader(data, rank=1, dp=2, tokenizer=spy)
    take(iter(dl), 40)
    assert spy.seen and {docs.index(t) % 8 for t in spy.seen} <= {1, 3, 5, 7}


def test_packing_concatenates_bos_doc_eos_per_shard(tmp_path, docs):
    """Rank 0 of dp=2 with 2 shards reads shard 0 alone: documents 0, 2, 4, ... packed, cycling."""
    path = write_txt(tmp_path / "docs.txt", docs)
    it = iter(loader(path, dp=2, gbs=2, shards=2))
    batches = [next(it) for _ in range(120)]
    stream = [t for b in batches for w in windows(b) for t in w]
    epoch = [t for d in docs[0::2] for t in TOK.encode(d, bos=True, eos=True)]
    assert len(stream) > 1.5 * len(epoch)  # the shard wrapped around into its second epoch
    assert stream == (epoch * 2)[: len(stream)]
    # Positions: each token's offset in its document, also where a window starts inside one.
    offsets = [i for d in docs[0::2] for i in range(len(TOK.encode(d, bos=True, eos=True)))] * 2
    window = SEQ + 1
    for k, b in enumerate(batches):
        assert b.positions[0].tolist() == offsets[k * window : k * window + SEQ]


@pytest.mark.parametrize("consumed", [3, 8])  # mid-step and at a step boundary
def test_resume_continues_exactly(data, consumed):
    reference = take(iter(loader(data, dp=2, rank=1, gbs=8, lbs=2)), 12)
    first = loader(data, dp=2, rank=1, gbs=8, lbs=2)
    it = iter(first)
    take(it, consumed)
    state = json.loads(json.dumps(first.state_dict()))  # plain data: survives any serialisation
    assert any(cursor["offset"] for cursor in state["shards"].values())  # inside a document: positions > 0
    resumed = loader(data, dp=2, rank=1, gbs=8, lbs=2)
    resumed.load_state_dict(pickle.loads(pickle.dumps(state)))
    assert take(iter(resumed), 12 - consumed) == reference[consumed * 2 :]
    assert take(it, 2) == reference[consumed * 2 : consumed * 2 + 4]  # saving does not disturb the run


@pytest.mark.parametrize("new_dp", [4, 1])
def test_resume_on_another_dp_degree(data, new_dp):
    gbs, before, after = 8, 7, 12
    reference = global_steps(ranks(data, 1, gbs=gbs), before + after, gbs)
    old = ranks(data, 2, gbs=gbs)
    first = global_steps(old, before, gbs // 2)
    merged = merge_loader_states([dl.state_dict() for dl in old])
    new = ranks(data, new_dp, gbs=gbs)
    for dl in new:
        dl.load_state_dict(merged)
    assert first + global_steps(new, after, gbs // new_dp) == reference


def test_merge_rejects_mid_step_and_incomplete_states(data):
    old = ranks(data, 2, gbs=8)
    take(iter(old[0]), 1)
    with pytest.raises(CheckpointError, match="step boundary"):
        merge_loader_states([dl.state_dict() for dl in old])
    with pytest.raises(CheckpointError, match="cover 4 of 8"):
        merge_loader_states([old[1].state_dict()])
    other_rank = loader(data, dp=2, rank=0, gbs=8)
    with pytest.raises(CheckpointError, match="lacks virtual shards"):
        other_rank.load_state_dict(old[1].state_dict())
    with pytest.raises(CheckpointError, match="virtual shards cannot change"):
        loader(data, gbs=8, shards=4).load_state_dict(old[1].state_dict())


def test_bad_data_is_skipped_with_counted_warnings(tmp_path, caplog):
    root = tmp_path / "mixed"
    (root / "sub").mkdir(parents=True)
    (root / "empty.txt").write_text("")
    (root / "blank.txt").write_text("\n  \n\t\n")
    (root / "binary.txt").write_bytes(bytes(range(256)) * 20)
    (root / "notes.csv").write_text("ignored,unsupported\n")
    (root / "latin1.txt").write_bytes("good paragraph\n\nbad caf\xe9\n\nanother good one\n".encode("latin-1"))
    long_doc = " ".join(["a long document"] * 400)  # ~1200 tokens: dozens of windows
    lines = [
        json.dumps({"text": "valid record one"}),
        "{not json",
        json.dumps({"body": "no text field"}),
        json.dumps({"text": 42}),
        json.dumps({"text": "   "}),
        json.dumps(["not", "an", "object"]),
        "",
        json.dumps({"text": long_doc}),
        json.dumps({"text": "surrogate \ud800 and special <|end_of_text|> text"}),
    ]
    (root / "sub" / "records.jsonl").write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        source = open_source(str(root), "text")
    assert source.num_documents == 2 + 3
    log = caplog.text
    assert "empty.txt: empty file" in log and "blank.txt: empty file" in log
    assert "binary.txt: binary file" in log
    assert "1 undecodable paragraphs; kept 2 documents" in log
    for why in (
        "1 lines with invalid JSON",
        "1 lines with no 'text' field",
        "1 lines with non-string 'text'",
        "1 lines with empty 'text'",
        "1 lines with not a JSON object",
    ):
        assert why in log
    assert len([r for r in caplog.records if "records.jsonl" in r.getMessage()]) == 1  # one summary per file
    it = iter(loader(root, gbs=4, shards=1))  # one shard: the stream is the documents in order
    text = TOK.decode([t for _ in range(60) for t in windows(next(it))[0]])
    assert long_doc in text and "another good one" in text


def test_nothing_usable_is_a_data_error(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"text": 1}\nnope\n')
    with pytest.raises(DataError, match="no usable documents"):
        loader(tmp_path)


@pytest.mark.parametrize("pattern", ["missing.jsonl", "missing_dir/", "*.nothing", "only_csv"])
def test_path_matching_nothing_is_a_data_error(tmp_path, pattern):
    (tmp_path / "only_csv").mkdir()
    (tmp_path / "only_csv" / "a.csv").write_text("x\n")
    path = str(tmp_path / pattern)
    with pytest.raises(DataError, match="matches no"):
        loader(path)


class EmptyFor:
    """The byte tokenizer, except that the documents `empty(text)` picks give no tokens (as damaged data's
    documents would come back)."""

    def __init__(self, empty) -> None:
        self.empty = empty
        self.path, self.n_words, self.bos_id, self.eos_id, self.pad_id = "", TOK.n_words, TOK.bos_id, TOK.eos_id, -1

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        return [] if self.empty(text) else TOK.encode(text, bos=bos, eos=eos)

    def decode(self, ids) -> str:
        return TOK.decode(ids)


@contextlib.contextmanager
def within(seconds: int):
    """Fail after `seconds` instead of hanging (the loop guarded against never returns)."""

    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_whole_pass_without_tokens_is_a_data_error_not_endless_epochs(tmp_path, docs):
    """Documents that all come back empty make every pass as empty as the last: the stream would start epoch
    after epoch without a sample. A whole pass without tokens is one error. A pass resumed after its documents
    with tokens is no whole pass: the stream goes on into the next (the control)."""
    data = write_jsonl(tmp_path / "d.jsonl", docs)
    with within(20), pytest.raises(DataError) as e:
        next(iter(loader(data, gbs=4, lbs=4, shards=2, tokenizer=EmptyFor(lambda text: True))))
    assert str(e.value) == (
        f"{data}: a whole pass over virtual shard 0 (30 documents) gave no tokens: its documents are empty"
    )
    tail_empty = EmptyFor(lambda text: int(text.split()[1].rstrip(":")) >= 40)  # "Document 40: ..." on
    state = loader(data, gbs=4, lbs=4, shards=2).state_dict()
    state["shards"] = {"0": {"epoch": 0, "doc": 20, "offset": 0}, "1": {"epoch": 0, "doc": 20, "offset": 0}}
    resumed = loader(data, gbs=4, lbs=4, shards=2, tokenizer=tail_empty)
    resumed.load_state_dict(state)
    with within(20):
        take(iter(resumed), 20)
    assert all(shard["epoch"] >= 1 for shard in resumed.state_dict()["shards"].values())


def test_fewer_documents_than_shards_is_a_data_error(tmp_path):
    path = write_jsonl(tmp_path / "few.jsonl", make_docs(5))
    with pytest.raises(DataError, match="5 documents, fewer than the 8 virtual shards"):
        loader(path, gbs=8)
    loader(path, gbs=8, shards=4)


def test_custom_text_field(tmp_path, docs):
    custom = write_jsonl(tmp_path / "custom.jsonl", docs, field="content")
    plain = write_txt(tmp_path / "plain.txt", docs)
    assert take(iter(loader(custom, field="content")), 20) == take(iter(loader(plain)), 20)
    with pytest.raises(DataError, match="no usable documents"):
        loader(custom)  # field "text" is missing everywhere


def test_glob_of_files_in_sorted_order(tmp_path, docs):
    parts = [docs[:20], docs[20:45], docs[45:]]
    for i, part in reversed(list(enumerate(parts))):
        write_jsonl(tmp_path / f"part-{i}.jsonl", part)
    (tmp_path / "skip.txt").write_text("not matched by the glob\n")
    write_jsonl(tmp_path / "all.jsonl.bak", docs)
    (tmp_path / "single").mkdir()
    single = write_jsonl(tmp_path / "single" / "all.jsonl", docs)
    assert open_source(str(tmp_path / "part-*.jsonl"), "text").num_documents == len(docs)
    assert take(iter(loader(tmp_path / "part-*.jsonl")), 16) == take(iter(loader(single)), 16)


def test_gzip_variants(tmp_path, docs):
    (tmp_path / "plain").mkdir()
    (tmp_path / "gz").mkdir()
    plain = write_txt(tmp_path / "plain" / "d.txt", docs)
    (tmp_path / "gz" / "d.txt.gz").write_bytes(gzip.compress(plain.read_bytes()))
    (tmp_path / "gz" / "e.jsonl.gz").write_bytes(gzip.compress(b'{"text": "one more"}\n'))
    assert open_source(str(tmp_path / "gz"), "text").num_documents == len(docs) + 1
    assert take(iter(loader(tmp_path / "gz")), 8) == take(iter(loader(plain)), 8)


def test_parquet(tmp_path, docs):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": docs + [None, ""]}), tmp_path / "d.parquet")
    plain = write_txt(tmp_path / "d.txt", docs)
    assert take(iter(loader(tmp_path / "d.parquet")), 8) == take(iter(loader(plain)), 8)


def _hf_files(monkeypatch, docs: list[str], n_files: int) -> list[int]:
    """`datasets.load_dataset` returns a local stream of `docs` in `n_files` data files (one generator call
    each, as `datasets` streams files); the list it returns records every file opened, in order."""
    import datasets

    opened: list[int] = []
    per_file = len(docs) // n_files

    def records(files):
        for f in files:
            opened.append(f)
            yield from ({"text": d} for d in docs[f * per_file : (f + 1) * per_file])

    def load_dataset(name, config, split, streaming):
        assert (name, config, split, streaming) == ("org/name", "cfg", "train", True)
        return datasets.IterableDataset.from_generator(records, gen_kwargs={"files": list(range(n_files))})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return opened


HF = "hf://org/name:cfg"


def test_hf_streams_are_sharded_at_the_source_and_do_not_depend_on_the_layout(monkeypatch, docs, caplog):
    opened = _hf_files(monkeypatch, docs, 32)  # 32 files, 8 virtual shards: 4 whole files a shard
    reference = global_steps(ranks(HF, 1, gbs=8), 12, 8)
    assert global_steps(ranks(HF, 2, gbs=8), 12, 4) == reference
    assert global_steps(ranks(HF, 4, gbs=8), 12, 2) == reference
    read = []
    for rank in range(2):
        dl = loader(HF, dp=2, rank=rank, gbs=8)
        opened.clear()  # (building the loader reads one document to check the dataset)
        take(iter(dl), 120)  # past an epoch: every owned file opened
        read.append(set(opened))
    assert len(read[0]) == len(read[1]) == 16 and not read[0] & read[1]  # each rank opens its half only
    assert "virtual shard stream reads the whole stream" not in caplog.text

    opened = _hf_files(monkeypatch, docs, 12)  # negative control: 12 files do not split into 8 shards
    dl = loader(HF, dp=2, rank=1, gbs=8)
    opened.clear()
    take(iter(dl), 120)
    assert set(opened) == set(range(12))
    assert "12 data files, not a multiple of the 8 virtual shards" in caplog.text


def test_hf_resume_continues_from_the_saved_stream_position(monkeypatch, docs):
    opened = _hf_files(monkeypatch, docs, 32)
    reference = take(iter(loader(HF, dp=2, rank=1, gbs=8)), 30)
    first = loader(HF, dp=2, rank=1, gbs=8)
    take(iter(first), 20)
    state = json.loads(json.dumps(first.state_dict()))  # plain data, as checkpoints keep it
    # The file holding each shard's current document (2 documents a file; shard v has files v, v + 8, ...).
    current = {int(v): int(v) + 8 * (cursor["doc"] // 2) for v, cursor in state["shards"].items()}
    assert any(current[v] > v for v in current)  # some shard is past its first file
    assert all("source" in cursor for cursor in state["shards"].values())
    opened.clear()
    resumed = loader(HF, dp=2, rank=1, gbs=8)
    resumed.load_state_dict(state)
    opened.clear()
    assert take(iter(resumed), 10) == reference[20:]
    from_position = list(opened)

    # Negative control: without the positions (a state saved before they were recorded) the streams
    # restart and skip documents: the same batches, but every shard reopens its first file.
    for cursor in state["shards"].values():
        del cursor["source"]
    opened.clear()
    skipping = loader(HF, dp=2, rank=1, gbs=8)
    skipping.load_state_dict(state)
    opened.clear()
    assert take(iter(skipping), 10) == reference[20:]
    assert {1, 3, 5, 7} <= set(opened)  # each of rank 1's shards begins with file v
    assert all(f >= current[f % 8] for f in from_position)  # no file a shard had left is opened again
    assert len(from_position) < len(opened)


def test_hf_needs_datasets(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match="pip install datasets"):
        loader("hf://org/name")


def test_layout_validation(data):
    with pytest.raises(ConfigError, match="not a multiple of the 3 virtual shards"):
        loader(data, gbs=8, shards=3)
    with pytest.raises(ConfigError, match="not a multiple of the data-parallel degree 3"):
        loader(data, gbs=12, dp=3, shards=4)
    with pytest.raises(ConfigError, match="local_batch_size 3 x data-parallel degree 2"):
        loader(data, gbs=8, lbs=3, dp=2)
    with pytest.raises(ConfigError, match="dataloader_num_workers 3"):
        loader(data, gbs=8, workers=3)
    with pytest.raises(ConfigError, match="dataloader_num_workers 2"):
        loader(data, gbs=8, lbs=1, shards=2, workers=2)  # 4 samples per shard and step > local batch


def test_workers_produce_the_single_process_stream(data):
    reference = take(iter(loader(data, dp=2, rank=0, gbs=16, lbs=2)), 10)
    dl = loader(data, dp=2, rank=0, gbs=16, lbs=2, workers=2)
    it = iter(dl)
    assert take(it, 3) == reference[:6]
    state = dl.state_dict()  # mid-step (4 microbatches per step)
    assert state["round_pos"] == 6
    single = loader(data, dp=2, rank=0, gbs=16, lbs=2)
    single.load_state_dict(state)
    assert take(iter(single), 7) == reference[6:]
    workers = loader(data, dp=2, rank=0, gbs=16, lbs=2, workers=2)
    workers.load_state_dict(state)
    assert take(iter(workers), 7) == reference[6:]
    assert take(iter(dl), 2) == reference[6:10]  # a new iterator continues where the last one stopped


def test_bundled_corpus_is_the_default():
    source = open_source("", "text")
    assert source.num_documents > 3000 and len(source.files) == 12
    files_docs = sum(len(p.read_text(encoding="utf-8").split("\n\n")) for p in source.files)
    assert files_docs == source.num_documents  # one paragraph per topic or docstring
    it = iter(loader("", gbs=8, seq_len=64))
    first = windows(next(it))[0]
    assert first[0] == TOK.bos_id
    assert TOK.decode(first).startswith('<|begin_of_text|>The "assert" statement')
    lengths = Counter(len(windows(next(it))[0]) for _ in range(5))
    assert lengths == Counter({65: 5})


def _zst(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor().compress(data)


@pytest.mark.parametrize(
    "name,encode",
    [
        ("c4-train.00000-of-01024.json", lambda b: b),  # JSON lines under .json, as C4 ships
        ("d.json.gz", gzip.compress),
        ("D.JSONL.GZ", gzip.compress),
        ("d.jsonl.zst", _zst),
        ("D.Json.Zst", _zst),
    ],
)
def test_json_lines_in_every_suffix_and_compression(tmp_path, docs, name, encode):
    pytest.importorskip("zstandard")
    plain = write_jsonl(tmp_path / "plain.jsonl", docs)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / name).write_bytes(encode(plain.read_bytes()))
    # Three epochs of shard 0 on rank 0 of 2: compressed files are reopened on every pass.
    assert take(iter(loader(tmp_path / "in", dp=2, gbs=2, shards=2)), 60) == take(
        iter(loader(plain, dp=2, gbs=2, shards=2)), 60
    )


def test_text_in_every_compression_and_case(tmp_path, docs):
    pytest.importorskip("zstandard")
    plain = write_txt(tmp_path / "plain.txt", docs)
    for name, encode in [("a.TXT", bytes), ("b.txt.gz", gzip.compress), ("c.Txt.Zst", _zst)]:
        (tmp_path / name.split(".")[0]).mkdir()
        (tmp_path / name.split(".")[0] / name).write_bytes(encode(plain.read_bytes()))
        assert take(iter(loader(tmp_path / name.split(".")[0])), 12) == take(iter(loader(plain)), 12), name


def test_compressed_files_are_streamed_not_read_whole(tmp_path):
    """16 MB of text in a .txt.gz: indexing and reading it never hold more than a few documents."""
    import tracemalloc

    paragraph = ("streamed line of text " * 40 + "\n") * 4 + "\n"  # ~3.5 KB
    path = tmp_path / "big.txt.gz"
    with gzip.open(path, "wt", compresslevel=1) as f:
        for i in range(4800):
            f.write(f"doc {i} " + paragraph)
    tracemalloc.start()
    try:
        source = open_source(str(path), "text")
        texts = list(islice(source.shard_documents(3, 4, 1000), 50))  # far into the file
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert source.num_documents == 4800 and texts[0].startswith("doc 4003 ")
    assert peak < 2 << 20, f"{peak:,} bytes traced for a {path.stat().st_size:,}-byte file of 16 MB of text"


def test_zst_without_zstandard_names_the_extra(tmp_path, monkeypatch):
    (tmp_path / "d.jsonl.zst").write_bytes(b"not read")
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(DataError, match=r"\.zst files need.*titanlite\[data\]"):
        loader(tmp_path)


def test_unsupported_files_are_one_warning_per_type_with_counts(tmp_path, docs, caplog):
    write_jsonl(tmp_path / "data.jsonl", docs)
    for name in ("a.csv", "b.csv", "sub/c.CSV", "README.md", "LICENSE"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("not data\n")
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        assert open_source(str(tmp_path), "text").num_documents == len(docs)
    skipped = sorted(r.getMessage().split(" in ")[0] for r in caplog.records)
    assert skipped == ["data: skipped 1 (no suffix) file", "data: skipped 1 .md file", "data: skipped 3 .csv files"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        open_source("", "text")  # the bundled corpus: its README is expected
    assert not caplog.records


def test_a_byte_order_mark_is_not_text(tmp_path):
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfFirst paragraph.\n\nSecond one.\n")
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "first record"}\n{"text": "second"}\n')
    source = open_source(str(tmp_path), "text")
    assert [source.document(d) for d in range(source.num_documents)] == [
        "first record",
        "second",
        "First paragraph.",
        "Second one.",
    ]


def test_each_new_epoch_is_logged_once_with_its_step(tmp_path, docs, caplog):
    """One shard, 4 samples a step: epoch e begins in the sample that needs token (e - 1) x T."""
    data = write_jsonl(tmp_path / "d.jsonl", docs)
    tokens = sum(len(TOK.encode(d, bos=True, eos=True)) for d in docs)
    expected = [f"data: epoch {e} begins at step {(e - 1) * tokens // (SEQ + 1) // 4 + 1}" for e in (2, 3)]
    steps = (2 * tokens // (SEQ + 1)) // 4 + 2
    with caplog.at_level(logging.INFO, logger="titanlite"):
        take(iter(loader(data, gbs=4, lbs=4, shards=1)), steps)
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: epoch")] == expected
    # Resumed a step before epoch 2: the step count is in the state.
    first = loader(data, gbs=4, lbs=4, shards=1)
    take(iter(first), int(expected[0].split()[-1]) - 1)
    state = first.state_dict()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="titanlite"):
        resumed = loader(data, gbs=4, lbs=4, shards=1)
        resumed.load_state_dict(state)
        take(iter(resumed), 1)
        old = loader(data, gbs=4, lbs=4, shards=1)  # a state saved before steps were counted
        old.load_state_dict({k: v for k, v in state.items() if k != "step"})
        take(iter(old), 1)
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: epoch")] == [
        expected[0],
        f"data: epoch 2 begins after {len(docs)} documents of virtual shard 0",
    ]


def test_a_text_file_read_in_chunks_of_any_size_has_the_paragraphs_of_reading_it_line_by_line(tmp_path, monkeypatch):
    """Paragraphs are runs of lines with a non-whitespace byte; the scan reads chunks, so a paragraph, a
    line or a UTF-8 character can straddle two. Reference: lines read one by one, here."""
    from titanlite.data import file_scan

    def by_lines(data: bytes) -> tuple[list[tuple[int, int]], int]:
        spans, bad, para, start, pos = [], 0, [], 0, 0
        lines = [x + b"\n" for x in data.split(b"\n")]
        lines[-1] = lines[-1][:-1]
        for line in [*lines, b""]:
            if line.strip():
                start = pos if not para else start
                para.append(line)
            elif para:
                text = b"".join(para)
                try:
                    text.strip().decode("utf-8")
                    spans.append((start + len(text) - len(text.lstrip()), len(text.strip())))
                except UnicodeDecodeError:
                    bad += 1
                para = []
            pos += len(line)
        return spans, bad

    rng = random.Random(0)
    pieces = [b"a", b"b", b" ", b"\t", b"\n", b"\n", b"\r", b"\x0b", b"\x0c", "é".encode(), b"\xff", b"\xe2\x82"]
    files = [b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 40))) for _ in range(300)]
    for chunk in (1, 2, 3, 7):
        monkeypatch.setattr(file_scan, "_SCAN_CHUNK", chunk)
        for data in files:
            spans, issues = [], Counter()
            file_scan._scan_txt(io.BytesIO(data), 0, "text", issues, spans, file_scan.index.content_hash())
            assert (spans, issues["undecodable paragraphs"]) == by_lines(data), (chunk, data)


def test_truncated_or_corrupt_compressed_files_are_skipped_with_a_warning(tmp_path, caplog):
    pytest.importorskip("zstandard")
    import zstandard

    lines = "".join(json.dumps({"text": f"record {i}"}) + "\n" for i in range(50)).encode()
    frame = zstandard.ZstdCompressor().compress(lines)
    (tmp_path / "two_frames.jsonl.zst").write_bytes(frame + frame)  # as parallel compressors write
    (tmp_path / "cut.jsonl.zst").write_bytes(frame + frame[:-5])
    (tmp_path / "garbage.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd" + bytes(range(200)))
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(lines)[:-12])
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        source = open_source(str(tmp_path), "text")
    assert source.num_documents == 100
    skipped = sorted(r.getMessage().split(": ")[1].removeprefix("skipped ") for r in caplog.records)
    assert [Path(s).name for s in skipped] == ["cut.jsonl.gz", "cut.jsonl.zst", "garbage.jsonl.zst"]
    assert "ends inside a Zstandard frame" in caplog.text


def test_a_truncated_gzip_file_keeps_its_readable_part_and_a_json_array_gets_a_hint(tmp_path, caplog):
    lines = [json.dumps({"text": f"record {i} " + "words " * 40}) for i in range(3000)]
    data = gzip.compress(("\n".join(lines) + "\n").encode())
    (tmp_path / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])  # a copy that stopped half-way
    (tmp_path / "array.json").write_text(json.dumps([{"text": "one"}, {"text": "two"}], indent=1))
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        source = open_source(str(tmp_path), "text")
    kept = source.num_documents
    assert 0 < kept < 3000, kept
    docs = list(source.shard_documents(0, 1, 0))
    assert docs == [json.loads(line)["text"] for line in lines[:kept]]  # every kept document reads back whole
    cut, array = sorted((r.getMessage() for r in caplog.records), key=lambda m: "array" in m)
    assert "cut.jsonl.gz: cannot read all of it (Compressed file ended" in cut
    assert cut.endswith(f"kept the {kept:,} documents before the damage")
    assert "array.json: skipped" in array and "kept 0 documents" in array
    assert "it looks like one JSON array: JSON Lines is expected, one object per line" in array


def test_the_index_is_kept_and_its_digest_sees_a_change_anywhere(tmp_path, docs, caplog):
    """The first open indexes and keeps the index; the next loads it (no scan: its warnings are replayed
    only where reported); a same-size edit in the middle changes the file's digest (the dataset
    fingerprint a resume checks)."""
    from titanlite.checkpoint.fingerprint import dataset_fingerprint

    data, index_dir = tmp_path / "data", str(tmp_path / "index")
    data.mkdir()
    path = write_jsonl(data / "a.jsonl", docs)
    (data / "b.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        first = open_source(str(data), "text", index_dir=index_dir)
        scans = []
        monkeypatch = pytest.MonkeyPatch()
        monkeypatch.setattr(type(first), "_index", lambda self, i, p: scans.append(p))
        again = open_source(str(data), "text", index_dir=index_dir)
        quiet = open_source(str(data), "text", index_dir=index_dir, report=False)
        monkeypatch.undo()
    assert scans == [] and first.num_documents == again.num_documents == quiet.num_documents == len(docs) + 1
    assert first.digests == again.digests
    assert [s.table().tolist() for s in first._spans] == [s.table().tolist() for s in again._spans]
    assert len([r for r in caplog.records if "1 lines with invalid JSON" in r.getMessage()]) == 2  # not `quiet`
    before = dataset_fingerprint(first, "text")
    text = path.read_bytes()
    middle = text.index(b"Document", len(text) // 2)
    stat = path.stat()
    path.write_bytes(text[:middle] + b"D0cument" + text[middle + 8 :])  # same size, one byte in the middle
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # a later edit (not within one tick)
    changed = open_source(str(data), "text", index_dir=index_dir)
    assert changed.digests[0] != first.digests[0] and changed.digests[1] == first.digests[1]
    assert dataset_fingerprint(changed, "text")["digest"] != before["digest"]
    assert dataset_fingerprint(open_source(str(data), "text"), "text") == dataset_fingerprint(changed, "text")


def test_the_data_lines_count_in_words_that_agree(tmp_path, caplog):
    """One file of one document reads "1 document in 1 file", not "1 documents in 1 files"; an empty
    folder's one line likewise."""
    one = tmp_path / "one.txt"
    one.write_text("a single document\n")
    with caplog.at_level(logging.INFO, logger="titanlite"):
        loader(one, gbs=1, shards=1)
    assert [r.getMessage() for r in caplog.records] == [f"data: 1 document in 1 file from {one}"]
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("")
    with pytest.raises(DataError) as e:
        loader(tmp_path / "empty", gbs=1, shards=1)
    assert str(e.value) == f"dataset_path {tmp_path / 'empty'}: no usable documents in 1 file"
