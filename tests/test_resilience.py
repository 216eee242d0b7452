"""Fault injection: preemption (and determinism), a crashed rank with restarts, non-finite losses.

Faults come from the test-only TITANLITE_FAULT_* environment variables (titanlite/faults.py).
Runs use the debug model with seq_len 64 and metrics every step, so each is a few seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import SMALL, RunResult, train


def run(dump: Path, *overrides: str, nproc: int = 2, launcher: str = "torchrun", **env: str) -> RunResult:
    return train(dump, nproc, *SMALL, *overrides, launcher=launcher, env=env)


def losses(dump: Path) -> dict[int, float]:
    out = {}
    for line in (dump / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[r["step"]] = r["loss"]
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    dump = tmp_path_factory.mktemp("ref")
    proc = run(dump, "--training.steps", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return losses(dump)


@pytest.mark.slow
def test_sigterm_saves_and_resumes_exactly(tmp_path, uninterrupted):
    """Steps 1-4 before the signal equal the uninterrupted run bitwise (two runs are deterministic), and
    so do steps 5-8 after the resume."""
    ck = ["--checkpoint.enable", "--checkpoint.interval", "100", "--training.steps", "8"]
    proc = run(tmp_path, *ck, TITANLITE_FAULT_SIGTERM_AT="4", TITANLITE_FAULT_RANK="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "stop signal (SIGTERM) at step 4: checkpoint saved to" in out
    assert (tmp_path / "checkpoint" / "step-4").is_dir()
    assert losses(tmp_path) == {s: uninterrupted[s] for s in range(1, 5)}  # exact float equality
    proc = run(tmp_path, *ck)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert losses(tmp_path) == uninterrupted


@pytest.mark.slow
def test_crashed_rank_restarts_from_checkpoint(tmp_path, uninterrupted):
    """run_train.sh passes comm.max_restarts to the launcher; the job comes back from the last checkpoint."""
    proc = run(
        tmp_path,
        *("--training.steps", "8", "--checkpoint.enable", "--checkpoint.interval", "2", "--comm.max_restarts", "1"),
        launcher="run_train",
        TITANLITE_FAULT_EXIT_AT="6",
        TITANLITE_FAULT_RANK="1",
        TITANLITE_FAULT_ONCE=str(tmp_path / "fired"),
        LOG_RANK="0,1",
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert (tmp_path / "fired").exists()
    got = losses(tmp_path)  # the log holds steps 1-5 of the first attempt, then 5-8 after the restart
    assert got[8] == uninterrupted[8]
    # The restart is announced once, with its cause; metrics.jsonl tells the two runs' rows apart.
    own = [line for line in proc.stderr.splitlines() if not line.startswith("[rank")]
    assert own == [
        "titanlite: restarting every rank (restart 1 of 1) after: rank 1 exited with code 17 (the ranks' "
        "logs are in " + own[0].split("logs are in ")[-1]
    ], own
    runs = [(r["run"], r["step"]) for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())]
    assert runs == [(1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (2, 5), (2, 6), (2, 7), (2, 8)], runs


@pytest.mark.slow
def test_nan_stops_with_last_good_checkpoint(tmp_path):
    proc = run(
        tmp_path,
        "--training.steps",
        "8",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        nproc=1,
        TITANLITE_FAULT_NAN_AT="5",
    )
    assert proc.returncode != 0
    err = [ln for ln in proc.stderr.splitlines() if "titanlite: error:" in ln]
    assert err and "non-finite step 5" in err[0] and "step-4" in err[0]
    # the checkpoint on disk is the last good one
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir() if p.name.startswith("step-")) == [
        "step-2",
        "step-4",
    ]


@pytest.mark.slow
def test_nan_step_is_skipped_within_limit(tmp_path, uninterrupted):
    proc = run(tmp_path, "--training.steps", "6", "--training.skip_nonfinite_steps", "1", TITANLITE_FAULT_NAN_AT="3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = losses(tmp_path)
    assert got[3] != got[3]  # NaN logged for the skipped step
    assert got[2] == uninterrupted[2] and all(got[s] == got[s] for s in (4, 5, 6))


class _StopAt:
    """A stop signal that arrives while step `at` runs (stands in for `signals.Preemption`)."""

    def __init__(self, at: int):
        self.at, self.received, self.name = at, None, "SIGTERM"


@pytest.mark.parametrize("ending", ["stop_signal", "error"])
def test_the_garbage_collector_is_enabled_again_however_training_ends(tmp_path, process_group, monkeypatch, ending):
    """The loop runs with the collector off; a stop signal's clean return and an error both turn it back on
    (the control: it is off while a step runs)."""
    import gc
    import signal

    from builders import config

    from harness import tiny_args
    from titanlite.plan import RunPlan
    from titanlite.trainer import Trainer

    cfg = config(
        tmp_path, training__seq_len=8, training__local_batch_size=2, training__steps=4, checkpoint__enable=True
    )
    stop = _StopAt(2)
    trainer = Trainer(cfg, RunPlan.build(cfg, 1, args=tiny_args(vocab_size=2056)), preemption=stop)
    step, enabled_in_step = trainer.train_step, []

    def train_step(batches):
        enabled_in_step.append(gc.isenabled())
        if trainer.step == stop.at:
            if ending == "error":
                raise RuntimeError("a failing step")
            stop.received = signal.SIGTERM
        return step(batches)

    monkeypatch.setattr(trainer, "train_step", train_step)
    try:
        if ending == "error":
            with pytest.raises(RuntimeError, match="a failing step"):
                trainer.train()
        else:
            trainer.train()
            assert trainer.step == 2 and trainer.preempted
    finally:
        trainer.close()
    assert enabled_in_step == [False, False] and gc.isenabled()
