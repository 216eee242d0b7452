"""Node-local checkpoints (`checkpoint.local_interval`, titanlite/checkpoint/node_local.py): a crashed rank
costs the steps since the last local save, exactly; a missing or damaged local copy loads the durable
checkpoint instead; copies are kept two per rank and deleted when the run ends cleanly.

Through `run_train.sh` (2 ranks, the small settings of test_resilience.py): a rank that exits at step 33
resumes from the local step 30, and a rank killed from outside (kill -9) whose copies were deleted falls
back to the durable step 20, both with the uninterrupted run's losses, bitwise. In one process (the
trainer's own loop): a corrupted copy and the copies of a checkpoint folder deleted since are not resumed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from builders import config

from harness import ROOT, SHALLOW, SMALL, RunResult, child_env, one_rank_group, rank_pid, threads, tiny_args, train
from titanlite.checkpoint import node_local
from titanlite.config import Checkpoint
from titanlite.planning.run_plan import RunPlan
from titanlite.run.trainer import Trainer

STEPS = ("--training.steps", "40")
LOCAL = ("--checkpoint.enable", "--checkpoint.local_interval", "5", "--comm.max_restarts", "1")


def losses(dump: Path) -> dict[int, float]:
    """Step -> loss of metrics.jsonl, a restarted attempt's rows replacing the first attempt's."""
    return {r["step"]: r["loss"] for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())}


def attempts(dump: Path) -> list[tuple[int, int]]:
    """(run, first step) of each attempt in metrics.jsonl."""
    firsts: dict[int, int] = {}
    for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines()):
        firsts.setdefault(r["run"], r["step"])
    return sorted(firsts.items())


def killed_from_outside(dump: Path, local: Path) -> tuple[RunResult, list[int]]:
    """run_train.sh on 2 ranks; once rank 0 has logged step 27 (after the durable save of step 20 and the
    local one of step 25), rank 1 is stopped, its node-local copies are deleted (a node replaced) and it is
    killed with SIGKILL. Returns the run and the steps of rank 0's copies at that moment."""
    args = [*SMALL, *SHALLOW, *STEPS, *LOCAL, "--checkpoint.interval", "20", "--checkpoint.local_folder", str(local)]
    proc = subprocess.Popen(
        [str(ROOT / "run_train.sh"), "--job.dump_folder", str(dump), *args],
        env=child_env(NGPU="2", OMP_NUM_THREADS=str(threads(2))),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics, deadline = dump / "metrics.jsonl", time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 27):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before step 27"
        time.sleep(0.05)
    pid = rank_pid(dump, 1)
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    shutil.rmtree(local / "rank-00001")
    held = node_local.NodeLocal(local, 0).steps()
    os.kill(pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    return RunResult(proc.returncode, out, err, dump), held


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[RunResult, list[int]]]:
    """The uninterrupted run, the run whose rank 1 exits at step 33, and the one killed from outside; two
    at a time (a launch's start-up keeps about one core busy)."""
    root = tmp_path_factory.mktemp("node_local")
    crash = {"TITANLITE_FAULT_EXIT_AT": "33", "TITANLITE_FAULT_RANK": "1", "TITANLITE_FAULT_ONCE": str(root / "fired")}
    plans = {
        "uninterrupted": lambda: (train(root / "uninterrupted", 2, *SMALL, *SHALLOW, *STEPS, launcher="torchrun"), []),
        "crash": lambda: (
            train(
                root / "crash",
                2,
                *SMALL,
                *SHALLOW,
                *STEPS,
                *LOCAL,
                "--checkpoint.interval",
                "50",
                "--checkpoint.local_folder",
                str(root / "crash-local"),
                launcher="run_train",
                env=crash,
            ),
            [],
        ),
        "killed": lambda: killed_from_outside(root / "killed", root / "killed-local"),
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(plan) for name, plan in plans.items()}
        return {name: future.result() for name, future in futures.items()}


@pytest.fixture(scope="module")
def uninterrupted(runs) -> dict[int, float]:
    run, _ = runs["uninterrupted"]
    return losses(run.ok().dump)


@pytest.mark.slow
def test_a_rank_that_exits_resumes_from_the_node_local_step_exactly(runs, uninterrupted):
    """Durable saves every 50 steps, local ones every 5: rank 1 exits before step 33, every rank restarts
    from the local step 30 (not from step 0) and trains to the uninterrupted run's losses, bitwise; the
    copies are gone once training finished."""
    run, _ = runs["crash"]
    run.ok()
    assert "checkpoint: resuming from the node-local checkpoint of step 30 (newer than the durable step 0)" in run.log
    assert attempts(run.dump) == [(1, 1), (2, 31)]
    assert losses(run.dump) == uninterrupted  # exact float equality, steps 1-40
    assert not (run.dump.parent / "crash-local").exists()


@pytest.mark.slow
def test_a_rank_killed_with_its_copies_deleted_falls_back_to_the_durable_checkpoint(runs, uninterrupted):
    """kill -9 from outside after rank 1's copies were deleted: rank 0's copies are newer than the durable
    step 20 but not every rank has one, so the run says so and resumes from step 20, never from a mix;
    rank 0 held at most two copies."""
    run, held = runs["killed"]
    run.ok()
    assert 1 <= len(held) <= 2 and held[-1] in (25, 30), held
    line = re.search(
        r"checkpoint: the node-local checkpoint of step (\d+) is missing on rank 1 \(it holds none\); "
        r"falling back to the durable step 20",
        run.log,
    )
    assert line and int(line[1]) == held[-1], run.log[-4000:]
    assert "resuming from the node-local" not in run.log
    assert attempts(run.dump) == [(1, 1), (2, 21)]
    assert losses(run.dump) == uninterrupted
    assert not (run.dump.parent / "killed-local").exists()


# --- one process, the trainer's own loop ---------------------------------------------------------------


class Crash(Exception):
    """A rank's crash inside a step."""


def trainer(dump: Path, steps: int, **keys) -> Trainer:
    cfg = config(
        dump,
        keys,
        training__seq_len=8,
        training__local_batch_size=2,
        training__steps=steps,
        training__deterministic=True,
        checkpoint__enable=True,
        checkpoint__interval=50,
        checkpoint__local_interval=2,
        checkpoint__local_folder=str(dump / "local"),
    )
    return Trainer(cfg, RunPlan.build(cfg, 1, args=tiny_args(vocab_size=2056)))


def train_in_process(dump: Path, steps: int, crash_at: int | None = None, **keys) -> tuple[dict[int, float], int]:
    """Train `dump`'s run to `steps` (crashing before step `crash_at`; `keys`: config keys as `config` takes
    them); (its losses, the step it started from)."""
    run, got = trainer(dump, steps, **keys), {}
    step = run.train_step
    started: list[int] = []

    def train_step(batches, context):
        started.append(run.step)
        if run.step == crash_at:
            raise Crash
        out = step(batches, context)
        got[run.step] = run.verdict.loss
        return out

    run.train_step = train_step
    try:
        run.train()
    except Crash:
        pass
    finally:
        run.close()
    return got, started[0] - 1


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The losses of the in-process run, uninterrupted."""
    with one_rank_group():
        return train_in_process(tmp_path_factory.mktemp("reference"), 6)[0]


@pytest.mark.parametrize("case", ["intact", "corrupted", "started_over", "other_layout"])
def test_only_an_intact_copy_of_this_line_is_resumed(tmp_path, process_group, caplog, reference, case):
    """A crash before step 5 leaves the copies of steps 2 and 4; the next run resumes step 4 and trains
    5-6 as an uninterrupted run does, bitwise. A flipped byte in the copy, the checkpoint folder deleted to
    start over, or another parallelism setting (a copy is never resharded) starts from step 0 instead, each
    said in one line, and no copy is left."""
    dump = tmp_path / "run"
    first, _ = train_in_process(dump, 6, crash_at=5)
    copies = node_local.NodeLocal(dump / "local", 0)
    assert copies.steps() == [2, 4] and first == {s: reference[s] for s in range(1, 5)}
    if case == "corrupted":
        state = copies.step_dir(4) / node_local.STATE
        data = bytearray(state.read_bytes())
        data[len(data) // 2] ^= 1
        state.write_bytes(bytes(data))
    if case == "started_over":
        shutil.rmtree(dump / "checkpoint")
    caplog.clear()
    relayout = {"parallelism__fsdp_reshard_after_forward": "always"} if case == "other_layout" else {}
    second, start = train_in_process(dump, 6, **relayout)
    assert second == {s: reference[s] for s in range(start + 1, 7)}
    lines = [r.getMessage() for r in caplog.records if "node-local" in r.getMessage()]
    if case == "intact":
        assert start == 4 and lines[0].startswith("checkpoint: resuming from the node-local checkpoint of step 4 ")
    elif case == "corrupted":
        assert start == 0 and len(lines) == 1, lines
        assert re.fullmatch(
            r"checkpoint: the node-local checkpoint of step 4 is unusable on rank 0: .*state\.pt has CRC-32 "
            r"[0-9a-f]{8}, its record says [0-9a-f]{8} \(corrupted\); falling back to the durable step 0",
            lines[0],
        ), lines
    else:
        why = {
            "started_over": r"its line of training is not that of .*/checkpoint \(deleted or replaced since it was "
            r"written\)",
            "other_layout": "it was written with parallelism.fsdp_reshard_after_forward auto, this run has always",
        }[case]
        assert start == 0 and len(lines) == 1, lines
        assert re.fullmatch(f"checkpoint: the node-local copy .*/local/rank-00000/step-4 is not used: {why}", lines[0])
    assert not (dump / "local").exists()


def test_a_rank_keeps_its_two_newest_copies_each_checked_on_load(tmp_path):
    """The writer keeps the newest two complete copies; a copy of the recorded size whose bytes changed
    is refused by its CRC-32, and one of another size is passed over for the older one."""
    copies = node_local.NodeLocal(tmp_path, 3)
    copies.record = {"line": "x"}
    for step in range(1, 6):
        copies.save(step, {"w": torch.full((4,), float(step)), "train_state": {"step": step}}, {"rank": 3})
    copies.close()
    assert copies.steps() == [4, 5] and copies.folder == tmp_path / "rank-00003"
    found, why = copies.read(5)
    assert why is None and found is not None
    assert found.payload["state"]["w"].tolist() == [5.0] * 4 and found.record["line"] == "x"
    state = copies.step_dir(5) / node_local.STATE
    state.write_bytes(state.read_bytes()[:-1] + bytes([state.read_bytes()[-1] ^ 0xFF]))
    assert "(corrupted)" in str(copies.read(5)[1])

    def unfit(line: str):
        return lambda record: None if record["line"] == line else "another line"

    assert copies.newest(unfit("x")) == (5, None)
    state.write_bytes(state.read_bytes() + b"\0")
    damaged = (5, "its record.json does not read or its state.pt is not of its size")
    assert copies.newest(unfit("x")) == (4, damaged) and copies.newest(unfit("y")) == (-1, damaged)


def test_the_default_folder_is_in_shared_memory_and_one_per_checkpoint_folder(tmp_path):
    def folder(dump: Path, **keys) -> Path:
        return node_local.folder_of(Checkpoint(**keys), str(dump))

    a, b = folder(tmp_path / "a"), folder(tmp_path / "b")
    assert a.parent == b.parent == Path("/dev/shm/titanlite") and a != b
    assert folder(tmp_path / "a", folder="elsewhere") != a
    assert folder(tmp_path / "a", local_folder="local") == tmp_path / "a" / "local"
    assert folder(tmp_path / "a", local_folder="/scratch/x") == Path("/scratch/x")
