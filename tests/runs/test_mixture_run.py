"""A weighted mixture through the shipped path: `run_train.sh` on two ranks with the bundled corpus at 0.8 and
a second JSONL at 0.2; the same run killed with SIGKILL after its step-3 checkpoint and relaunched in its
folder; the step-3 checkpoint resumed on four ranks (dp2 x tp2). Every step is logged (SMALL)."""

from __future__ import annotations

import json

import pytest

from harness import LOSS_REL, SHALLOW, SMALL, assert_resumed, copy_checkpoint, step_metric, train, train_in_one_launch
from titanlite.faults import KILL_AT

STEPS, SAVE = 6, 3
DP2XTP2 = ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"]


@pytest.mark.slow
def test_a_mixture_follows_its_weights_resumes_exactly_after_a_kill_and_reshards(tmp_path):
    code = tmp_path / "code.jsonl"
    code.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}"}) + "\n" for i in range(32)))
    run = [*SMALL, *SHALLOW, "--training.steps", str(STEPS), "--training.global_batch_size", "8"]
    run += ["--checkpoint.enable", "--checkpoint.interval", str(SAVE), "--training.datasets", f":0.8,{code}:0.2"]
    first = train(tmp_path / "first", 2, *run, launcher="run_train").ok()
    assert "data: mixture corpus 0.8 + code 0.2" in first.stderr
    seen = {name: step_metric(first.dump, f"tokens_seen/{name}") for name in ("corpus", "code")}
    for step in range(1, STEPS + 1):  # 8 samples of 64 tokens a step: within one sample of the weights
        total = step * 8 * 64
        assert seen["corpus"][step] + seen["code"][step] == total
        assert abs(seen["corpus"][step] - 0.8 * total) <= 64, (step, seen)
    killed = train(tmp_path / "killed", 2, *run, env={KILL_AT: str(SAVE)})
    assert killed.returncode != 0 and f"{KILL_AT}={SAVE}: killing this process" in killed.stderr, killed.log[-3000:]
    logged = len(killed.metrics)
    moved = copy_checkpoint(first.dump, tmp_path / "dp2xtp2", SAVE)
    restart = train_in_one_launch([(killed.dump, run)], 2)[killed.dump]
    resharded = train(moved, 4, *run, *DP2XTP2).ok()
    assert_resumed(restart, SAVE)
    assert_resumed(resharded, SAVE)
    after = {r["step"]: r for r in killed.metrics[logged:]}
    reference = {r["step"]: r for r in first.metrics if r["step"] > SAVE}
    # Relaunched after the kill: every step bitwise as uninterrupted, and the same tokens per source.
    assert {s: r["loss"] for s, r in after.items()} == {s: r["loss"] for s, r in reference.items()}
    keys = ("tokens_seen/corpus", "tokens_seen/code")
    assert {s: [r[k] for k in keys] for s, r in after.items()} == {
        s: [r[k] for k in keys] for s, r in reference.items()
    }
    # On dp2 x tp2: the same tokens seen, the losses within the reduction-order tolerance.
    other = {r["step"]: r for r in resharded.metrics}
    assert {s: [r[k] for k in keys] for s, r in other.items()} == {
        s: [r[k] for k in keys] for s, r in reference.items()
    }
    for step, r in reference.items():
        assert abs(other[step]["loss"] - r["loss"]) <= LOSS_REL * abs(r["loss"]), (step, other[step], r)
