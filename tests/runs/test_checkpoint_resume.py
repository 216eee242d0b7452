"""Resume through the real entry point (torchrun, gloo, fp32, deterministic): exact resume, kill -9, resharding.

Every run trains the debug model cut to 2 blocks (`SHALLOW`) for 4 steps (seq_len 64, global batch 8) and
checkpoints every 2 steps, so "10 steps, stop, resume to 20" becomes "2 steps, stop, resume to 4"; losses come
from metrics.jsonl.

The kill -9 test uses the test hook TITANLITE_FAULT_KILL_AT (titanlite/faults.py) and restarts in the same dump
folder, as a relaunch would.

Validation: every run holds out the corpus's last documents (the same training stream for all); the
reference and the dp2 x tp2 run evaluate on them every 2 steps, and so does the restart after the kill,
while the killed run does not. The restart matching the reference bitwise shows that validation changes
nothing in training (data, RNG, weights); it also matches the reference's validation loss bitwise.

Tolerances: resuming on the same layout (after a kill during an async save, or from a
pp2 x dp2 checkpoint) must reproduce the uninterrupted losses of every resumed step bitwise. Resuming
on another layout (other dp degree, tp, FSDP2, pipeline stages, one process) changes only the order of floating-point
reductions, so losses must agree within a relative 1e-5 (observed: ~1e-7).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harness import LOSS_REL, SHALLOW, SMALL, RunResult, assert_ok, assert_resumed, copy_checkpoint, train_in_one_launch
from harness import train as run_trainer
from titanlite.checkpoint import folders, rank_state
from titanlite.faults import KILL_AT as TEST_KILL_ENV

pytestmark = pytest.mark.slow

STEPS, INTERVAL = 4, 2
LAYOUTS = {
    "dp2": (2, []),
    "dp2xtp2": (4, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"]),
    "dp4_fsdp2": (4, ["--parallelism.dp_impl", "fsdp2"]),
    "single": (1, []),
    "pp2xdp2": (4, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]),
}


HOLDOUT = ["--validation.holdout_documents", "64"]
VALIDATION = [
    "--validation.enable",
    "--validation.freq",
    "2",
    "--validation.steps",
    "2",
    "--validation.local_batch_size",
    "2",
]


def overrides(layout: str, *extra: str) -> list[str]:
    steps = ["--training.steps", str(STEPS), "--training.local_batch_size", "2", "--training.global_batch_size", "8"]
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", str(INTERVAL)]
    return [*SMALL, *SHALLOW, *steps, *ckpt, *HOLDOUT, *LAYOUTS[layout][1], *extra]


def train(dump: Path, layout: str, *extra: str, kill_at: str = "") -> RunResult:
    env = {TEST_KILL_ENV: kill_at} if kill_at else {}
    return run_trainer(dump, LAYOUTS[layout][0], *overrides(layout, *extra), env=env)


def _records(dump: Path) -> list[dict]:
    path = dump / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def losses(dump: Path, skip: int = 0) -> dict[int, float]:
    """Loss per step, from the records after the first `skip` (a restarted run appends to metrics.jsonl)."""
    return {r["step"]: r["loss"] for r in _records(dump)[skip:] if "loss" in r}


def val_losses(dump: Path) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in _records(dump) if "val_loss" in r}


def after(reference: Path, step: int) -> dict[int, float]:
    return {s: v for s, v in losses(reference).items() if s > step}


def checkpoint(dump: Path) -> Path:
    return dump / "checkpoint"


@dataclass
class Killed:
    """The run killed during its async save of step 4 (as its restart found it), and the restart in its
    folder, as a relaunch would."""

    proc: RunResult
    scan: tuple[list[int], list[int]]
    partial_metadata: bool
    logged: int
    restart: RunResult


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    """Every run of the module, two launches at a time, each started once the run it resumes from has
    finished: the dp2 reference (SimpleFSDP, async saves, uninterrupted, validation every 2 steps); a dp2
    run killed during the async save of step 4 and restarted (`Killed`); in one 4-rank launch
    (`harness.train_in_one_launch`), the reference's step-2 resumed on FSDP2 dp4, on dp2 x tp2 (async
    saves, validation) and on pp2 x dp2 (saving every step), then that pipeline run's step-3 resumed on
    pp2 x dp2; and the step-3 resumed on dp2 and on one process. Name -> (dump folder, result)."""
    root = tmp_path_factory.mktemp("resume")
    done: dict[str, Future] = {}
    async_validated = ("--checkpoint.async_mode", "async", *VALIDATION)

    def fresh(name: str, layout: str, *extra: str) -> tuple[Path, RunResult]:
        return root / name, train(root / name, layout, *extra)

    def resumed(name: str, src: str, step: int, layout: str, *extra: str) -> tuple[Path, RunResult]:
        source, proc = result(src)
        assert_ok(proc)
        dump = copy_checkpoint(source, root / name, step)
        return dump, train(dump, layout, *extra)

    def killed_and_restarted() -> tuple[Path, Killed]:
        dump = root / "killed"
        proc = train(dump, "dp2", "--checkpoint.async_mode", "async", kill_at="4:mid_save")
        scan, partial = folders.scan(checkpoint(dump)), (checkpoint(dump) / "step-4.partial" / ".metadata").exists()
        logged = len(_records(dump))
        return dump, Killed(proc, scan, partial, logged, train(dump, "dp2", *async_validated))

    def on_four_ranks() -> dict[str, tuple[Path, RunResult]]:
        source, proc = done["reference"].result()
        assert_ok(proc)
        four = {
            "dp4_fsdp2": ("dp4_fsdp2", []),
            "dp2xtp2": ("dp2xtp2", async_validated),
            "pp2xdp2": ("pp2xdp2", ["--checkpoint.interval", "1"]),
            "pp_to_pp2xdp2": ("pp2xdp2", []),
        }
        for name in ("dp4_fsdp2", "dp2xtp2", "pp2xdp2"):
            copy_checkpoint(source, root / name, INTERVAL)
        copy = {root / "pp_to_pp2xdp2": checkpoint(root / "pp2xdp2") / f"step-{INTERVAL + 1}"}
        runs = [(root / name, overrides(layout, *extra)) for name, (layout, extra) in four.items()]
        results = train_in_one_launch(runs, 4, copy_before=copy)
        return {dump.name: (dump, proc) for dump, proc in results.items()}

    def result(name: str) -> tuple[Path, RunResult]:
        return done[name].result() if name in done else done["four"].result()[name]

    with ThreadPoolExecutor(max_workers=2) as pool:

        def submit(name: str, fn: Callable, *args: Any) -> None:
            done[name] = pool.submit(fn, *args)

        submit("reference", fresh, "reference", "dp2", *async_validated)
        submit("killed", killed_and_restarted)
        submit("four", on_four_ranks)
        for layout in ("dp2", "single"):
            submit(f"pp_to_{layout}", resumed, f"pp_to_{layout}", "pp2xdp2", INTERVAL + 1, layout)
        return {name: result(name) for name in (*done, *done["four"].result()) if name != "four"}


@pytest.fixture(scope="module")
def reference(runs) -> Path:
    dump, proc = runs["reference"]
    assert_ok(proc)
    assert folders.scan(checkpoint(dump)) == ([2, 4], [])
    assert sorted(val_losses(dump)) == [2, 4]
    return dump


def _assert_resumed(proc: RunResult, step: int) -> None:
    assert "resumed from" in proc.stderr, proc.stderr[-3000:]
    assert_resumed(proc, step)


def test_kill_during_async_save_keeps_previous_checkpoint(reference, runs):
    """Rank 0 is SIGKILLed while finalising the async save of step 4 (data written, no marker yet): the
    restart skips the incomplete step-4, resumes from step-2 exactly, and its validation (off in the
    killed run) logs the uninterrupted run's validation loss bitwise."""
    dump, killed = runs["killed"]
    assert killed.proc.returncode != 0 and f"{TEST_KILL_ENV}=4:mid_save: killing this process" in killed.proc.stderr
    assert killed.scan == ([2], [4])
    assert killed.partial_metadata
    proc = killed.restart
    assert_ok(proc)
    assert "step-4.partial is incomplete (no completion marker: an interrupted save)" in proc.stderr
    _assert_resumed(proc, 2)
    assert losses(dump, skip=killed.logged) == after(reference, 2)
    assert val_losses(dump) == {STEPS: val_losses(reference)[STEPS]}
    assert folders.scan(checkpoint(dump)) == ([2, 4], [])


def _assert_close(got: dict[int, float], expected: dict[int, float], first: int) -> None:
    assert sorted(got) == list(range(first, STEPS + 1)), got
    for step, loss in got.items():
        assert abs(loss - expected[step]) <= LOSS_REL * abs(expected[step]), (step, loss, expected[step])


def test_reshard_simple_fsdp_dp2_to_fsdp2_dp4(reference, runs):
    """The reference's step-2 resumed on 4 ranks with FSDP2 (dp 2 -> 4): torch's FSDP2 through the CLI,
    against SimpleFSDP."""
    run, proc = runs["dp4_fsdp2"]
    assert_ok(proc)
    _assert_resumed(proc, INTERVAL)
    assert "resharded from world 2, dp 2, tp 1" in proc.stderr
    _assert_close(losses(run), losses(reference), INTERVAL + 1)


def test_reshard_dp2_to_dp2_tp2(reference, runs):
    """Same dp degree, new tp: each rank continues its dp rank's data; the validation loss (same held-out
    batches for dp 2, vocab-parallel loss under tp) agrees with the dp2 reference's."""
    run, proc = runs["dp2xtp2"]
    assert_ok(proc)
    _assert_resumed(proc, INTERVAL)
    assert "resharded from world 2, dp 2, tp 1" in proc.stderr
    _assert_close(losses(run), losses(reference), INTERVAL + 1)
    got, expected = val_losses(run)[STEPS], val_losses(reference)[STEPS]
    assert abs(got - expected) <= LOSS_REL * expected, (got, expected)
    # One reader per replica (run/replica_batches.py): the tp rank 1s received their batches and
    # never advanced their own loaders past the resumed step.
    saved = [rank_state.read(checkpoint(run) / f"step-{STEPS}", r)["dataloader"]["step"] for r in range(4)]
    assert saved == [STEPS, INTERVAL, STEPS, INTERVAL]


def test_reshard_dp2_to_pp2_dp2(reference, runs):
    """The reference's step-2 resumed on pipeline 2 x dp_shard 2 (1F1B, 2 microbatches, 2 accumulation
    batches), saving every step: each stage loads only its blocks' FQNs from the one-stage checkpoint."""
    run, proc = runs["pp2xdp2"]
    assert_ok(proc)
    _assert_resumed(proc, INTERVAL)
    _assert_close(losses(run), losses(reference), INTERVAL + 1)


def test_exact_resume_pp2_dp2(runs):
    """A pipeline checkpoint (step 3) resumed on the same pipeline layout reproduces step 4 bitwise."""
    src, _ = runs["pp2xdp2"]
    run, proc = runs["pp_to_pp2xdp2"]
    assert_ok(proc)
    _assert_resumed(proc, INTERVAL + 1)
    assert "resharded" not in proc.stderr
    assert losses(run) == after(src, INTERVAL + 1)


def test_reshard_pp2_dp2_to_dp2(reference, runs):
    """Both stages' parameters and optimizer state join on each rank of a pipeline-free dp 2 (pp 1)."""
    run, proc = runs["pp_to_dp2"]
    assert_ok(proc)
    _assert_resumed(proc, INTERVAL + 1)
    assert "resharded from world 4, dp 2, tp 1" in proc.stderr
    _assert_close(losses(run), losses(reference), INTERVAL + 2)


def test_reshard_pp2_dp2_to_one_process(reference, runs):
    """Every stage's parameters, optimizer state and the loader state land on one process (as an FSDP2
    dp 4 checkpoint would: the same world-4-to-1 resharding)."""
    run, proc = runs["pp_to_single"]
    assert_ok(proc)
    _assert_resumed(proc, INTERVAL + 1)
    assert "resharded from world 4, dp 2, tp 1" in proc.stderr
    _assert_close(losses(run), losses(reference), INTERVAL + 2)
