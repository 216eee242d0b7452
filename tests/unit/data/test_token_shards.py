"""Pre-tokenized data (`data/token_shards.py`, `tools/tokenize.py`): the shards hold what on-the-fly tokenization
makes, document by document and batch by batch; the dtype follows the vocabulary; another tokenizer, an
unfinished or a truncated folder is refused in one line; an interrupted tokenization resumes to the same bytes;
damaged document offsets are one line where a shard is first read; more shards than open files are allowed
are read through; a shard whose bytes changed is refused by its digest, checked once per shard by the
preflight while the ranks open no shard to start (`data/verified_shards.py`). The slow tests drive the tool
and `run_train.sh` end to end."""

from __future__ import annotations

import builtins
import gzip
import hashlib
import io
import itertools
import json
import os
import resource
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from harness import ROOT, SHALLOW, SMALL, child_env, train
from titanlite.config import DEFAULT_CONFIG, load_config
from titanlite.data import file_streams
from titanlite.data.loader import build_dataloader
from titanlite.data.open_files import OPEN_FILES
from titanlite.data.sources import BUNDLED_CORPUS, open_source
from titanlite.data.tiktoken_bpe import BUNDLED_VOCAB
from titanlite.data.token_shards import INDEX, MAGIC, PLAN, TokenShards, shard_name, token_dtype, write_shard
from titanlite.data.tokenizer import build_tokenizer
from titanlite.errors import DataError, run_cli
from titanlite.faults import TOKENIZE_KILL_AFTER
from titanlite.launcher import preflight
from titanlite.planning.run_plan import RunPlan
from titanlite.run.loader import build_loader, build_validation_loader, data_index_dir
from titanlite.tools import tokenize
from titanlite.tools.tokenize import tokenize_source

PER_SHARD = 500  # the bundled corpus's 3,851 documents in 8 shards


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokens")
    tokenize_source("", "text", "", out, workers=1, per_shard=PER_SHARD)
    return out


def loader(path: str, tokenizer_path: str = "", **over):
    args = dict(seq_len=32, local_batch_size=4, global_batch_size=8, dp_rank=0, dp_degree=1)
    return build_dataloader(
        tokenizer=build_tokenizer(tokenizer_path), dataset_path=path, text_field="text", **{**args, **over}
    )


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def damage_offsets(path: Path, damage) -> np.ndarray:
    """Rewrite the document offsets of the shard file at `path` as `damage(offsets)` makes them (same size);
    returns the offsets it had."""
    data = bytearray(path.read_bytes())
    at = len(MAGIC) + 8
    end = at + 8 * (int.from_bytes(data[len(MAGIC) : at], "little") + 1)
    offsets = np.frombuffer(bytes(data[at:end]), dtype=np.int64)
    data[at:end] = damage(offsets.copy()).tobytes()
    path.write_bytes(bytes(data))
    return offsets


def swap_11th_and_12th(offsets: np.ndarray) -> np.ndarray:
    offsets[[10, 11]] = offsets[[11, 10]]
    return offsets


def change_a_token(path: Path) -> None:
    """The middle token of the shard at `path` changed in place to another id of the bundled vocabulary (its
    lowest bit flipped): same size and header, every id in range."""
    tokens = json.loads((path.parent / INDEX).read_text())["shards"][int(path.stem.split("-")[1])]["tokens"]
    at = path.stat().st_size - 2 * (tokens // 2)
    with open(path, "r+b") as f:
        f.seek(at)
        token = int.from_bytes(f.read(2), "little")
        f.seek(at)
        f.write((token ^ 1).to_bytes(2, "little"))


def shard_accesses(monkeypatch, folder: Path) -> Counter:
    """From now on, each open and stat of a shard file of `folder` by this process, counted by (call, file)."""
    seen: Counter = Counter()
    for module, name in ((builtins, "open"), (io, "open"), (os, "open"), (os, "stat")):
        real = getattr(module, name)

        def counted(path, *args, real=real, name=name, **kwargs):
            if isinstance(path, (str, Path)) and Path(path).parent == folder and Path(path).name.startswith("shard-"):
                seen[name, Path(path).name] += 1
            return real(path, *args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return seen


def test_the_shards_hold_the_on_the_fly_tokens_document_by_document(folder):
    text, tokens, tokenizer = open_source("", "text"), open_source(str(folder), "text"), build_tokenizer("")
    assert isinstance(tokens, TokenShards) and tokens.dtype == np.uint16
    assert tokens.num_documents == text.num_documents == 3851
    for shard in (0, 5):  # virtual shard streams of V = 8, as a run reads them
        expected = [tokenizer.encode(t, bos=True, eos=True) for t in text.shard_documents(shard, 8, 0)]
        assert list(tokens.shard_documents(shard, 8, 0)) == expected
    # A whole loader: the same batches and positions, and the same state to resume from.
    for a, b in itertools.islice(zip(loader(""), loader(str(folder))), 40):
        assert a.inputs.equal(b.inputs) and a.labels.equal(b.labels) and a.positions.equal(b.positions)


def test_a_run_resumes_and_holds_out_documents_as_with_text(folder):
    ahead, fly = loader(str(folder), holdout_documents=10), loader("", holdout_documents=10)
    for _ in itertools.islice(zip(ahead, fly), 7):
        pass
    state = ahead.state_dict()
    assert state == fly.state_dict()
    resumed = loader(str(folder), holdout_documents=10)
    resumed.load_state_dict(state)
    for a, b in itertools.islice(zip(resumed, fly), 5):
        assert a.inputs.equal(b.inputs)
    held = loader(str(folder), holdout_documents=10, heldout=True, global_batch_size=4, local_batch_size=4)
    held_text = loader("", holdout_documents=10, heldout=True, global_batch_size=4, local_batch_size=4)
    assert next(iter(held)).inputs.equal(next(iter(held_text)).inputs)


def test_the_dtype_follows_the_vocabulary(tmp_path):
    assert (token_dtype(2056), token_dtype(65536), token_dtype(65537), token_dtype(151_669)) == (
        "uint16",
        "uint16",
        "uint32",
        "uint32",
    )
    docs = [[1, 65535, 65536, 151_668], [7]]
    shard = write_shard(tmp_path / shard_name(0), docs, "uint32")
    assert (shard.documents, shard.tokens) == (2, 5)
    data = (tmp_path / shard_name(0)).read_bytes()
    assert np.frombuffer(data[-20:], dtype=np.uint32).tolist() == [1, 65535, 65536, 151_668, 7]
    with pytest.raises(OverflowError):  # never wrapped into uint16
        write_shard(tmp_path / shard_name(1), docs, "uint16")


def test_another_tokenizer_is_refused_before_any_rank_starts(folder, tmp_path, capsys):
    other = tmp_path / "other.tiktoken"
    other.write_bytes(b"".join(BUNDLED_VOCAB.read_bytes().splitlines(keepends=True)[:-1]))
    args = ["--job.dump_folder", str(tmp_path / "dump"), "--training.dataset_path", str(folder)]
    assert run_cli(preflight.main, [*args, "--model.tokenizer_path", str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"titanlite: error: training.dataset_path {folder} was tokenized with "
    ), err
    assert f"this run's tokenizer is {other}" in err[0]
    assert run_cli(preflight.main, args) == 0  # the tokenizer that made it


def test_an_unfinished_or_truncated_folder_is_refused_and_an_unfinished_one_resumes(folder, tmp_path):
    whole = files(folder)
    out = tmp_path / "tokens"
    tokenize_source("", "text", "", out, workers=1, per_shard=PER_SHARD)
    assert files(out) == whole
    # Interrupted: no index, two shards missing, one write cut short under its temporary name.
    (out / INDEX).unlink()
    (out / shard_name(3)).unlink()
    (out / shard_name(7)).rename(out / f".{shard_name(7)}.123.tmp")
    with pytest.raises(DataError, match=r"an unfinished tokenization \(6 of 8 shards\); run the same"):
        open_source(str(out), "text")
    tokenize_source("", "text", "", out, workers=1, per_shard=PER_SHARD)
    assert files(out) == whole
    # Complete, then a shard cut short (a copy that failed): refused, never read as whole.
    with open(out / shard_name(2), "r+b") as f:
        f.truncate(1000)
    with pytest.raises(DataError, match=f"shard {shard_name(2)} is 1,000 bytes, not "):
        open_source(str(out), "text")
    # A folder begun with another shard size is not continued with this one.
    with pytest.raises(DataError, match="holds a tokenization of other documents_per_shard"):
        tokenize_source("", "text", "", out, workers=1, per_shard=PER_SHARD + 1)


def test_a_compressed_file_is_decompressed_once_not_once_per_document(tmp_path, monkeypatch):
    data = tmp_path / "docs.jsonl.gz"
    lines = [json.dumps({"text": f"document {i}: " + "word " * (i % 7)}) + "\n" for i in range(50)]
    with gzip.open(data, "wt") as f:
        f.writelines(lines)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "docs.jsonl").write_text("".join(lines))
    opened = []
    real = file_streams.open_stream
    monkeypatch.setattr(
        file_streams, "open_stream", lambda path, compression: opened.append(path) or real(path, compression)
    )
    open_source(str(data), "text")
    indexing = len(opened)  # the index scan's reads
    opened.clear()
    tokenize_source(str(data), "text", "", tmp_path / "gz", workers=1, per_shard=50)
    assert len(opened) - indexing <= 1, f"{data} opened {len(opened) - indexing} times to tokenize it"
    tokenize_source(str(tmp_path / "plain"), "text", "", tmp_path / "ref", workers=1, per_shard=50)
    assert (tmp_path / "gz" / shard_name(0)).read_bytes() == (tmp_path / "ref" / shard_name(0)).read_bytes()


def test_an_unfinished_folder_resumes_after_the_data_and_tokenizer_move(folder, tmp_path, monkeypatch):
    """The plan compares what the data and tokenizer hold (digests, text field), not where they are."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    for f in sorted(BUNDLED_CORPUS.glob("*.txt")):
        shutil.copy(f, a)
    shutil.copy(BUNDLED_VOCAB, tmp_path / "vocab-a.tiktoken")
    out = tmp_path / "tokens"
    tokenize_source(str(a), "text", str(tmp_path / "vocab-a.tiktoken"), out, workers=1, per_shard=PER_SHARD)
    whole = files(out)
    (out / INDEX).unlink()  # as if interrupted after the first shards
    for k in range(3, 8):
        (out / shard_name(k)).unlink()
    shutil.copytree(a, b)
    shutil.copy(BUNDLED_VOCAB, tmp_path / "vocab-b.tiktoken")
    monkeypatch.chdir(tmp_path)
    tokenize_source("./b", "text", "vocab-b.tiktoken", out, workers=1, per_shard=PER_SHARD)
    assert files(out) == whole
    assert [p.read_bytes() for p in sorted(folder.glob("shard-*"))] == [
        out.joinpath(n).read_bytes() for n in sorted(whole) if n.startswith("shard-")
    ]


def test_a_corrupt_plan_index_or_shard_is_refused_in_one_line(folder, tmp_path, capsys):
    out = tmp_path / "begun"
    out.mkdir()
    (out / PLAN).write_text("{not json")
    assert run_cli(tokenize.main, ["--out", str(out), "--workers", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"titanlite: error: --out {out}: cannot read {PLAN} ("), err
    # A complete folder whose index lacks a key, or a shard that is not a shard file.
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    index = json.loads((copy / INDEX).read_text())
    for key in ("shards", "dtype", "documents"):
        (copy / INDEX).write_text(json.dumps({k: v for k, v in index.items() if k != key}))
        with pytest.raises(DataError, match=f"{INDEX} has no {key!r}.*: tokenize the data again"):
            open_source(str(copy), "text")
    (copy / INDEX).write_text(json.dumps(index))
    with open(copy / shard_name(4), "r+b") as f:
        f.write(b"NOTTOKEN")
    with pytest.raises(DataError, match=f"shard {shard_name(4)} is not a token shard.*: tokenize the data again"):
        open_source(str(copy), "text")
    # A resumed tokenization does not take it as a written shard.
    (copy / INDEX).unlink()
    with pytest.raises(DataError, match=f"shard {shard_name(4)} is not a token shard"):
        tokenize_source("", "text", "", copy, workers=1, per_shard=PER_SHARD)


def test_out_naming_a_file_is_refused_in_one_line(tmp_path, capsys):
    """--out that is a file, or lies inside one (a mixture's sources go to --out/<name>), says so."""
    file = tmp_path / "tokens.bin"
    file.write_text("")
    for out, what in ((file, f"--out {file}"), (file / "web", f"--out {file / 'web'}: {file}")):
        assert run_cli(tokenize.main, ["--out", str(out), "--workers", "1"]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"titanlite: error: {what} is a file, not a folder: name a new or empty folder"
        ]
    assert file.read_text() == ""


def test_a_token_id_beyond_the_vocabulary_is_a_damaged_shard_in_one_line(folder, tmp_path):
    """A flipped bit in a shard's tokens (same size and header: only the contents can tell) that makes an id
    no token of the tokenizer is refused where the document is read, naming the shard and the document,
    before it reaches the embedding, also in a loader worker; the other documents read as before (the
    control)."""
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    first = TokenShards(str(copy))
    path = copy / shard_name(0)
    data = bytearray(path.read_bytes())
    tokens = first.meta["shards"][0]["tokens"]
    at = len(data) - 2 * tokens + 2 * (len(first.document(0)) + len(first.document(1)) + 3)  # document 2's 4th
    data[at : at + 2] = (65535).to_bytes(2, "little")
    path.write_bytes(bytes(data))
    damaged = TokenShards(str(copy))
    assert [damaged.document(d) for d in (0, 1, 3)] == [first.document(d) for d in (0, 1, 3)]
    with pytest.raises(DataError) as e:
        damaged.document(2)
    line = (
        f"dataset_path {copy}: shard {shard_name(0)} holds token id 65535 in document 2, beyond the tokenizer's "
        f"{first.vocab_size} ids (a damaged file): tokenize the data again"
    )
    assert str(e.value) == line
    # Read by a loader worker, the error reaches the loop re-raised by torch with the worker's traceback as
    # its message: it still reads as its one line (virtual shard 0 of 2 streams documents 0, 2, ...).
    with pytest.raises(DataError) as e:
        for _ in loader(str(copy), virtual_shards=2, num_workers=1):
            pass
    assert str(e.value) == line and "Original Traceback" in e.value.args[0]


def test_a_corpus_of_more_shards_than_open_files_allowed_trains_past_all_of_them(tmp_path):
    """Every virtual shard stream strides over all the shard files: with more of them than a descriptor limit
    24 above what this process holds (a test process holds 20 to 150), the loader reads a whole pass of every
    stream (so every file) and on, keeping at most `OPEN_FILES` shards open."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = len(os.listdir("/proc/self/fd")) + 24  # 24 free, whatever the held ones' numbers
    shards = max(128, limit + 1)
    data = tmp_path / "docs.jsonl"
    lines = (json.dumps({"text": f"document {i}: " + "word " * (i % 5)}) + "\n" for i in range(4 * shards))
    data.write_text("".join(lines))
    out = tmp_path / "tokens"
    tokenize_source(str(data), "text", "", out, workers=1, per_shard=4)
    assert len(list(out.glob("shard-*.bin"))) == shards
    run = loader(str(out))
    batches = iter(run)
    assert limit < shards <= soft
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        for _ in range(4 * shards):
            next(batches)
            if all(cursor["epoch"] >= 1 for cursor in run.state_dict()["shards"].values()):
                break
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert all(cursor["epoch"] >= 1 for cursor in run.state_dict()["shards"].values())
    assert len(run.dataset.source._files) <= OPEN_FILES


def test_damaged_offsets_are_a_damaged_shard_in_one_line(folder, tmp_path):
    """A shard's offsets damaged at its size (all moved by 1e9, two swapped) would make documents empty or
    cut wrongly: the shard is refused where it is first read, naming it; the other shards read as before (the
    control). A shard cut short while it is read is one line too."""
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    whole = TokenShards(str(copy))
    damage_offsets(copy / shard_name(3), lambda offsets: offsets + 10**9)
    was = damage_offsets(copy / shard_name(5), swap_11th_and_12th)
    damaged = TokenShards(str(copy))
    others = [0, 499, 500, 1499, 2000, 2499, 3000, 3850]  # shards 0, 1, 2, 4, 6, 7
    assert [damaged.document(d) for d in others] == [whole.document(d) for d in others]
    line = f"dataset_path {copy}: shard {{}} has damaged document offsets ({{}}): tokenize the data again"
    with pytest.raises(DataError) as e:
        damaged.document(3 * PER_SHARD + 7)
    assert str(e.value) == line.format(shard_name(3), "they begin at token 1,000,000,000, not 0")
    tokens = whole.meta["shards"][5]["tokens"]
    span = f"document 2510 is tokens [{was[11]:,}, {was[10]:,}) of the shard's {tokens:,}"  # its first wrong one
    for d in (5 * PER_SHARD, 5 * PER_SHARD + 400):
        with pytest.raises(DataError) as e:
            damaged.document(d)
        assert str(e.value) == line.format(shard_name(5), span)
    # Whole when first read, then cut short: the document it cut is refused.
    with open(copy / shard_name(0), "r+b") as f:
        f.truncate(f.seek(0, os.SEEK_END) - 2)
    with pytest.raises(DataError, match=f"shard {shard_name(0)} ends inside document 499 \\(it changed while"):
        damaged.document(499)


@pytest.mark.slow
def test_damaged_offsets_stop_a_run_in_one_line(folder, tmp_path):
    """Every shard's offsets moved by 1e9, so that every document would read empty, as written (tokens.json
    lists the damaged shards' digests: what a faulty writer makes, which the preflight's digest check passes):
    `run_train.sh` stops at the first document with one line, exit code 2, instead of starting epoch after
    epoch without a step."""
    copy = tmp_path / "damaged"
    shutil.copytree(folder, copy)
    meta = json.loads((copy / INDEX).read_text())
    for k in range(8):
        damage_offsets(copy / shard_name(k), lambda offsets: offsets + 10**9)
        meta["shards"][k]["digest"] = hashlib.blake2b((copy / shard_name(k)).read_bytes(), digest_size=16).hexdigest()
    (copy / INDEX).write_text(json.dumps(meta))
    run = [*SMALL, *SHALLOW, "--training.steps", "2", "--training.dataset_path", str(copy)]
    proc = train(tmp_path / "dump", 1, *run, launcher="run_train", timeout=90)
    assert proc.returncode == 2, proc.log[-3000:]
    assert [line for line in proc.stderr.splitlines() if line.startswith("titanlite:")] == [
        f"titanlite: error: dataset_path {copy}: shard {shard_name(0)} has damaged document offsets (they begin "
        "at token 1,000,000,000, not 0): tokenize the data again"
    ]
    assert "Traceback" not in proc.log and not proc.losses


def test_each_shard_is_verified_once_by_the_preflight_and_no_rank_opens_one_to_start(folder, tmp_path, monkeypatch):
    """The preflight reads every shard for its digest once; the next launch's preflight stats them and reads
    none; a shard rewritten with the same bytes (a new modification time) is the only one read again. A rank's
    training and held-out loaders after it open and stat no shard to start."""
    copy, dump = tmp_path / "copy", tmp_path / "dump"
    shutil.copytree(folder, copy)
    args = ["--job.dump_folder", str(dump), "--training.dataset_path", str(copy)]
    args += ["--validation.enable", "--validation.holdout_documents", "32"]
    seen = shard_accesses(monkeypatch, copy)
    shards = sorted(p.name for p in copy.glob("shard-*.bin"))
    assert run_cli(preflight.main, args) == 0
    assert [seen[("open", s)] for s in shards] == [1] * 8  # its digest's read
    seen.clear()
    assert run_cli(preflight.main, args) == 0
    assert sorted(seen) == [("stat", s) for s in shards] and set(seen.values()) == {1}
    seen.clear()
    plan = RunPlan.build(load_config(args, default_config=DEFAULT_CONFIG), 2)
    loaders = [build_loader(plan, dp_rank=r, report=False) for r in range(2)]
    loaders += [build_validation_loader(plan, dp_rank=r) for r in range(2)]
    assert not seen, seen
    next(iter(loaders[1]))  # reading opens the shards it reads (and only then)
    assert seen and {call for call, _ in seen} == {"open"}
    path = copy / shard_name(5)
    path.write_bytes(path.read_bytes())
    seen.clear()
    assert run_cli(preflight.main, args) == 0
    assert [s for (call, s) in seen if call == "open"] == [shard_name(5)]


def test_a_token_id_changed_in_range_is_refused_by_its_shards_digest(folder, tmp_path, capsys):
    """A token id changed to another valid id, in place (same size and header: only the digest can tell), after
    the folder was verified: the next preflight reads that shard again and refuses it in one line naming it,
    exit code 2; a process that finds no record verifies itself and refuses it too. The unchanged folder
    passes (the control)."""
    copy, dump = tmp_path / "copy", tmp_path / "dump"
    shutil.copytree(folder, copy)
    args = ["--job.dump_folder", str(dump), "--training.dataset_path", str(copy)]
    assert run_cli(preflight.main, args) == 0
    change_a_token(copy / shard_name(3))
    assert run_cli(preflight.main, args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    line = (
        f"training.dataset_path {copy}: shard {shard_name(3)} does not match its digest in {INDEX} (its bytes "
        "changed since it was written: a damaged file): tokenize the data again"
    )
    assert err == [f"titanlite: error: {line}"], err
    with pytest.raises(DataError, match=f"shard {shard_name(3)} does not match its digest"):
        open_source(str(copy), "text", index_dir=str(tmp_path / "another_index"))
    assert open_source(str(folder), "text", index_dir=str(tmp_path / "another_index")).num_documents == 3851
    assert data_index_dir(load_config(args, default_config=DEFAULT_CONFIG)) == str(dump / "data_index")


@pytest.mark.slow
def test_tokenized_interrupted_and_resumed_then_trained_on_gives_the_on_the_fly_losses(tmp_path):
    """The tool killed after its third shard (2 worker processes), run again, then `run_train.sh` on the
    folder and on the text: the same losses, bitwise; then, a token id of the folder changed in range, in one
    line and exit code 2 (the run before is the control)."""
    out = tmp_path / "tokens"
    cmd = [sys.executable, "-m", "titanlite.tools.tokenize", "--out", str(out), "--workers", "2"]
    cmd += ["--documents_per_shard", str(PER_SHARD)]
    killed = subprocess.run(cmd, env=child_env(**{TOKENIZE_KILL_AFTER: "3"}), cwd=ROOT, capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert not (out / INDEX).exists() and 3 <= len(list(out.glob("shard-*.bin"))) < 8
    done = subprocess.run(cmd, env=child_env(), cwd=ROOT, capture_output=True)  # bytes: "\r" kept
    stdout, stderr = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, stderr[-3000:]
    assert stdout.splitlines() == [f"tokenized 3,851 documents into 605,529 tokens (uint16, 8 shards): {out}"]
    assert stderr.count("\n") == 1 and stderr.endswith("\n") and "3,851/3,851 documents (100%)" in stderr  # one line
    reference = tmp_path / "reference"
    tokenize_source("", "text", "", reference, workers=1, per_shard=PER_SHARD)
    assert files(out) == files(reference)
    run = [*SMALL, *SHALLOW, "--training.steps", "4"]
    on_the_fly = train(tmp_path / "text", 2, *run, launcher="run_train").ok()
    ahead = train(tmp_path / "ahead", 2, *run, "--training.dataset_path", str(out), launcher="run_train").ok()
    assert len(on_the_fly.losses) == 4 and ahead.losses == on_the_fly.losses
    assert f"data: 3,851 documents in 8 files from {out}" in ahead.stderr
    # A token id changed to another valid one in place after that run verified the folder: refused in one line.
    change_a_token(out / shard_name(6))
    damaged = train(
        tmp_path / "ahead", 2, "--training.dataset_path", str(out), "--training.steps", "2", launcher="run_train"
    )
    assert damaged.returncode == 2, damaged.log[-3000:]
    assert damaged.log.strip().splitlines() == [
        f"titanlite: error: training.dataset_path {out}: shard {shard_name(6)} does not match its digest in {INDEX} "
        "(its bytes changed since it was written: a damaged file): tokenize the data again"
    ]
    assert os.environ.get(TOKENIZE_KILL_AFTER) is None
