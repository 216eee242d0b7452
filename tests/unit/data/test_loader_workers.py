"""The data loader's worker processes: started by the fork server, never forked from the training process.

A rank starts its loader's workers when it first iterates, after its process group exists (on CUDA: a CUDA
context and NCCL communicators). These tests look at the workers the trainer itself starts (their parent
process and its command line, from /proc), in a fresh run and after a resume, check that the losses do not
change, and that what the workers need crosses a pickle: sources, Llama 3-sized tokenizers, logging.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from builders import config, llama3_sized_tiktoken, loader
from test_data import HF, _hf_files, make_docs, write_jsonl

from harness import ROOT, child_env, tiny_args
from titanlite.data.tokenizer import build_tokenizer
from titanlite.planning.run_plan import RunPlan
from titanlite.run.trainer import Trainer

LINUX = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")


def stat(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the command name: state, parent, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def parent(pid: int) -> int:
    return int(stat(pid)[1])


def running(pid: int) -> bool:
    try:
        return stat(pid)[0] != "Z"
    except FileNotFoundError:
        return False


def command(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def ancestry(pid: int) -> tuple[int, int, str]:
    """A process's parent, its parent's parent and its parent's command line."""
    up = parent(pid)
    return up, parent(up), command(up)


def run(dump: Path, steps: int, workers: int) -> tuple[list[float], list[dict[int, tuple[int, int, str]]]]:
    """A trainer of the tiny model (2 microbatches a step), trained by `Trainer.train` to `steps` with a
    checkpoint at the end; its losses and, at each step, its loader's workers (pid: `ancestry`)."""
    cfg = config(
        dump,
        training__seq_len=8,
        training__local_batch_size=2,
        training__global_batch_size=4,
        training__steps=steps,
        training__dataloader_num_workers=workers,
        checkpoint__enable=True,
        checkpoint__interval=2,
    )
    trainer = Trainer(cfg, RunPlan.build(cfg, 1, args=tiny_args(vocab_size=2056)))
    step, losses, workers_seen = trainer.train_step, [], []

    def train_step(batches, context):
        iterator = trainer.dataloader._iterator
        workers_seen.append({w.pid: ancestry(w.pid) for w in iterator._workers} if workers else {})
        out = step(batches, context)
        losses.append(out[0].item())
        return out

    trainer.train_step = train_step
    try:
        trainer.train()
    finally:
        trainer.close()
    return losses, workers_seen


def check_started_by_the_fork_server(workers: dict[int, tuple[int, int, str]]) -> None:
    """Each worker's parent is the fork server, a fresh interpreter that this process started by exec
    (its command line is not this process's), never this process."""
    me = os.getpid()
    assert len(workers) == 2
    for pid, (server, servers_parent, server_command) in workers.items():
        assert server != me, f"worker {pid} was forked from the training process"
        assert servers_parent == me and "multiprocessing.forkserver" in server_command
        assert server_command != command(me)


@LINUX
@pytest.mark.slow
def test_the_trainers_workers_come_from_the_fork_server_also_after_a_resume(tmp_path, process_group):
    first, first_workers = run(tmp_path / "run", 2, workers=2)
    resumed, resumed_workers = run(tmp_path / "run", 4, workers=2)  # from step 2: the iterator starts anew
    reference, _ = run(tmp_path / "single", 4, workers=0)
    assert first + resumed == reference  # bitwise: the workers produce the single-process stream
    assert len(first_workers) == len(resumed_workers) == 2
    assert first_workers[0] == first_workers[1] and resumed_workers[0] == resumed_workers[1]  # one start a run
    assert not set(first_workers[0]) & set(resumed_workers[0])  # the resumed run's workers are new ones
    check_started_by_the_fork_server(first_workers[0])
    check_started_by_the_fork_server(resumed_workers[0])


def batches(dl, n: int) -> list[list[list[list[int]]]]:
    """`n` batches of `dl`, each field as nested lists."""
    it = iter(dl)
    return [[field.tolist() for field in next(it)] for _ in range(n)]


@pytest.mark.slow  # a 128,000-rank tokenizer built and pickled into 2 workers: about 5 s
def test_workers_read_parquet_and_gzip_with_a_llama3_sized_tokenizer(tmp_path):
    """What a worker reads crosses a pickle (the fork server shares no memory with the loader's process):
    parquet and gzip sources and a 128,256-token vocabulary give the single-process stream."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    docs = make_docs(40)
    tokenizer = llama3_sized_tiktoken(tmp_path)
    assert tokenizer.n_words == 128_256
    pq.write_table(pa.table({"text": docs[:20]}), tmp_path / "a.parquet")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": d}) + "\n" for d in docs[20:]))
    data = str(tmp_path / "*.*")  # a.parquet, b.jsonl.gz (tokenizer.model: skipped, one warning)
    kw = dict(gbs=8, lbs=2, tokenizer=tokenizer)
    single = batches(loader(data, **kw), 12)
    assert batches(loader(data, workers=2, **kw), 12) == single
    assert max(max(map(max, b[0])) for b in single) >= 128_000  # its BOS: this tokenizer's ids


def test_an_hf_stream_pickles_without_its_open_stream(monkeypatch):
    """An hf:// loader has opened its stream to check it; a worker gets the dataset without it and opens
    its own (here in this process: the test's stand-in for `datasets` exists only here)."""
    _hf_files(monkeypatch, make_docs(64), 32)
    dataset = loader(HF, dp=2, rank=1, gbs=8).dataset
    assert dataset.source._stream is not None
    copy = pickle.loads(pickle.dumps(dataset))
    assert copy.source._stream is None
    for a, b in zip(iter(dataset), [next(it) for it in [iter(copy)] for _ in range(12)]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


WORKER_SCRIPT = """
import logging, os, sys, time
from builders import loader

log = logging.getLogger("titanlite")
handler = logging.StreamHandler()
handler.setFormatter(logging.Formatter("[worker log] %(levelname)s %(message)s"))
log.addHandler(handler)
log.setLevel(logging.INFO)
dl = loader(sys.argv[1], gbs=8, lbs=4, shards=2, workers=2)
batches = iter(dl)
for _ in range({steps}):
    next(batches)
print(" ".join(str(w.pid) for w in batches._workers), flush=True)
time.sleep(300)
"""


@LINUX
@pytest.mark.slow
def test_workers_log_as_the_loader_process_and_end_when_it_is_killed(tmp_path):
    """Worker 0's epoch line comes once, in the loader process's format. After a SIGKILL of that process
    nothing is left: each worker ends with it (`WorkerSetup`; torch's own watchdog watches the worker's
    parent, the fork server), then the fork server, which lives while any worker does."""
    docs = make_docs(20)
    data = write_jsonl(tmp_path / "d.jsonl", docs)
    per_shard = sum(len(build_tokenizer(None).encode(d, bos=True, eos=True)) for d in docs[::2])
    steps = per_shard // 33 // 4 + 2  # into epoch 2 of shard 0 (4 windows of 33 tokens a step from it)
    script = WORKER_SCRIPT.format(steps=2 * steps)  # 2 microbatches a step
    env = child_env(PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    err = tmp_path / "stderr"
    with err.open("w") as stderr:  # a file: a pipe would stay open while any worker lives
        proc = subprocess.Popen(
            [sys.executable, "-c", script, str(data)], stdout=subprocess.PIPE, stderr=stderr, env=env, text=True
        )
    pids: list[int] = []
    servers: set[int] = set()
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2, err.read_text()
        servers = {parent(p) for p in pids}
        assert servers != {proc.pid} and {parent(s) for s in servers} == {proc.pid}
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    epochs = [line for line in err.read_text().splitlines() if "data: epoch 2 " in line]
    assert epochs == [f"[worker log] INFO data: epoch 2 begins at step {steps - 1}"]
    deadline, left = time.monotonic() + 30, [*pids, *servers]
    while left and time.monotonic() < deadline:
        left = [p for p in left if running(p)]
        time.sleep(0.2)
    for pid in left:  # (a failed test leaves nothing behind either)
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running after the loader process was killed: {left}"


@pytest.mark.slow
def test_a_run_with_workers_logs_nothing_about_its_entry_point(tmp_path):
    """`python -m titanlite.train` with a worker: each worker runs the entry point as `__mp_main__`, which the
    fork server has not imported before it (else runpy warns, in the rank's log, that the module was found
    in sys.modules before its execution)."""
    from harness import SHALLOW, SMALL, train

    run = train(tmp_path, 1, *SMALL, *SHALLOW, "--training.steps", "1", "--training.dataloader_num_workers", "1")
    assert len(run.ok().losses) == 1
    assert "Warning" not in run.stderr, run.stderr[-2000:]
