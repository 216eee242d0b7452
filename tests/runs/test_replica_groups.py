"""Replica groups (fault_tolerance.enable) as users run them: a lighthouse from `titanlite.tools.lighthouse` and
each group its own `run_train.sh` with its own dump folder, on CPU with gloo.

The failure run: two groups of one rank; at step KILL_AT of group 1 its rank is killed with SIGKILL from
outside; its launcher restarts it (comm.max_restarts 1), it receives the state of group 0 and rejoins. Group 0
never restarts and trains on with a quorum of one while group 1 is away. After the rejoin both groups' weights
are bitwise equal (`ft/params_digest`) and they log the same loss. The parity run: two groups without a failure
train the losses of one run with data_parallel_replicate_degree 2; one group alone (other data) is the
negative control.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from replica_groups import finish, rows, start_group, start_lighthouse, wait_for_step

from harness import LOSS_REL, RunResult, rank_pid, train
from titanlite.metrics.goodput import latest, ledger_path, read_rows
from titanlite.tools.dashboard import read_dashboard

pytestmark = pytest.mark.slow

STEPS, KILL_AT = 40, 15


@pytest.fixture(scope="module")
def failure(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("replica_groups")
    lighthouse = start_lighthouse(tmp)
    steps = ["--training.steps", str(STEPS), "--fault_tolerance.timeout_seconds", "20"]
    try:
        g0, dump0 = start_group(tmp, lighthouse.address, 0, *steps)
        g1, dump1 = start_group(tmp, lighthouse.address, 1, *steps, "--comm.max_restarts", "1")
        wait_for_step(dump1, KILL_AT, g1)
        killed_at = max(r["step"] for r in RunResult(0, "", "", dump1).metrics if "loss" in r)
        pid = rank_pid(dump1, 0)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        results = {0: finish(g0, dump0), 1: finish(g1, dump1)}
    finally:
        lighthouse_code = lighthouse.stop()
    return {"results": results, "killed_at": killed_at, "lighthouse": lighthouse_code, "log": lighthouse.log}


def rejoin_step(result: RunResult) -> int:
    """The step group 1 rejoined at after its restart (it may also have joined late at the start, when group
    0 trained a first step alone)."""
    restarted = result.log.split("titanlite: restarting every rank (restart 1 of 1)")
    assert len(restarted) == 2, result.log[-4000:]
    lines = [line for line in restarted[1].splitlines() if "replica group 1 rejoined at step" in line]
    assert len(lines) == 1, restarted[1][-4000:]
    return int(lines[0].split("rejoined at step ")[1].split(":")[0])


def test_both_groups_finish_and_the_lighthouse_stops_cleanly(failure):
    for result in failure["results"].values():
        assert result.returncode == 0, result.log[-4000:]
    assert failure["lighthouse"] == 0
    assert failure["log"].read_text().splitlines()[-1] == "lighthouse: stopped"


def test_the_survivor_keeps_stepping_with_a_quorum_of_one_and_never_restarts(failure):
    g0 = failure["results"][0]
    logged = rows(g0)
    # One attempt, each step once from its first (the group that asks the lighthouse first may train step 1
    # alone; the other joins with its state).
    first = logged[0]["step"]
    assert first <= 2 and [r["step"] for r in logged] == list(range(first, STEPS + 1))
    assert "restarting" not in g0.log.lower()
    after_kill = [r for r in logged if r["step"] > failure["killed_at"]]
    assert any(r["ft/quorum_size"] == 1 for r in after_kill), [r["ft/quorum_size"] for r in after_kill]
    assert logged[-1]["ft/quorum_size"] == 2
    # TensorBoard shows the ft/ scalars of every log step, as metrics.jsonl holds them.
    [run] = (g0.dump / "tb").iterdir()
    board = read_dashboard(str(run))
    for tag in ("ft/quorum_size", "ft/recoveries", "ft/missed_steps", "ft/params_digest"):
        assert [v for _, v in board.scalars[tag].values] == [r[tag] for r in logged], tag


def test_the_killed_group_restarts_receives_the_state_and_rejoins(failure):
    g1 = failure["results"][1]
    joined = rejoin_step(g1)
    assert failure["killed_at"] <= joined < STEPS
    second = [r for r in rows(g1) if r["step"] > joined]
    assert [r["step"] for r in second] == list(range(joined + 1, STEPS + 1))
    # Missed: the steps group 0 trained alone, from the last step group 1 committed (the last it logged, or
    # one more killed between its commit and its log line) to the rejoin, beside any it missed at the start.
    first = [r for r in rows(g1) if r["step"] <= failure["killed_at"]]
    missed = second[0]["ft/missed_steps"] - first[-1]["ft/missed_steps"]
    assert second[0]["ft/recoveries"] >= 1
    assert joined - failure["killed_at"] - 1 <= missed <= joined - failure["killed_at"], missed
    # The goodput ledger sums to the steps the job trained without the group.
    ledger = latest(read_rows(ledger_path(g1.dump)))
    assert sum(row.get("missed_steps", 0) for row in ledger.values()) == second[-1]["ft/missed_steps"] > 0
    g0_after = {r["step"]: r for r in rows(failure["results"][0])}
    assert g0_after[STEPS]["ft/recoveries"] >= 1  # group 0 sent the state


def test_after_the_join_the_groups_weights_are_bitwise_equal_and_the_loss_is_continuous(failure):
    g0 = {r["step"]: r for r in rows(failure["results"][0])}
    g1_rows = rows(failure["results"][1])
    joined = rejoin_step(failure["results"][1])
    after = [r for r in g1_rows if r["step"] > joined]
    for r in after:
        assert r["ft/params_digest"] == g0[r["step"]]["ft/params_digest"], r["step"]
        assert r["loss"] == g0[r["step"]]["loss"], r["step"]
    # Continuous: no jump back to an untrained model's loss (8.1), close to the survivor's last one alone.
    assert after[0]["loss"] < 7.0 and abs(after[0]["loss"] - g0[joined]["loss"]) < 1.0
    # The control: before the kill the digests agree too, and a digest does change from step to step.
    before = [r for r in g1_rows if 1 < r["step"] < failure["killed_at"]]
    assert all(r["ft/params_digest"] == g0[r["step"]]["ft/params_digest"] for r in before)
    assert len({r["ft/params_digest"] for r in before}) > 1


@pytest.fixture(scope="module")
def parity(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("replica_parity")
    steps = ["--training.steps", "8", "--metrics.log_freq", "1"]
    lighthouse = start_lighthouse(tmp, min_replicas=2)
    try:
        both = "--fault_tolerance.min_replica_size", "2"
        g0, dump0 = start_group(tmp, lighthouse.address, 0, *steps, *both)
        g1, dump1 = start_group(tmp, lighthouse.address, 1, *steps, *both)
        groups = [finish(g0, dump0).ok(), finish(g1, dump1).ok()]
    finally:
        lighthouse.stop()
    replicated = train(
        tmp / "replicate2",
        2,
        *steps,
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
        launcher="run_train",
    ).ok()
    return {"groups": groups, "replicated": replicated}


def relative(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_two_groups_train_the_losses_of_one_run_with_two_replicas(parity):
    g0, g1 = parity["groups"]
    assert g0.losses == g1.losses
    assert relative(g0.losses, parity["replicated"].losses) <= LOSS_REL


def test_the_parity_check_fails_for_one_replicas_data(parity, tmp_path):
    """The negative control: one replica's data alone (a single run of one rank) leaves the tolerance."""
    single = train(tmp_path / "single", 1, "--training.steps", "8", "--metrics.log_freq", "1").ok()
    assert relative(single.losses, parity["replicated"].losses) > LOSS_REL


def train_groups(tmp: Path, *overrides: str, kill_at: int = 0) -> list[RunResult]:
    """Two groups into tmp/group0 and tmp/group1 that wait for each other (`min_replica_size 2`) at every
    quorum; with `kill_at`, both launches are killed (SIGKILL to each launch's process group, a lost job) once
    group 0 has logged that step."""
    tmp.mkdir(exist_ok=True)
    lighthouse = start_lighthouse(tmp, min_replicas=2)
    try:
        both = ["--fault_tolerance.min_replica_size", "2", *overrides]
        (g0, dump0), (g1, dump1) = (start_group(tmp, lighthouse.address, k, *both) for k in (0, 1))
        if kill_at:
            wait_for_step(dump0, kill_at, g0)
            for proc in (g0, g1):
                os.killpg(proc.pid, signal.SIGKILL)
        return [finish(g0, dump0), finish(g1, dump1)]
    finally:
        lighthouse.stop()


def test_a_whole_job_restart_resumes_from_the_lowest_groups_checkpoint_exactly(tmp_path):
    """The lowest live group (0) writes the durable checkpoints, group 1 none. Both groups lost at step 6 and
    started again: group 0 resumes from its checkpoint of step 4, group 1 (no checkpoint of its own) receives
    it, its own data position included, at the first quorum; steps 5-10 are those of the job never stopped."""
    ckpt = ["--training.steps", "10", "--checkpoint.enable", "--checkpoint.interval", "4"]
    never = [r.ok() for r in train_groups(tmp_path / "never", *ckpt)]
    lost = train_groups(tmp_path / "lost", *ckpt, kill_at=6)
    assert all(r.returncode != 0 for r in lost)
    again = [r.ok() for r in train_groups(tmp_path / "lost", *ckpt)]
    assert "checkpoint: resumed from" in again[0].log and "rejoined at step 4:" in again[1].log
    expected = {r["step"]: r["loss"] for r in rows(never[0])}
    for group in again:
        resumed = rows(group)[-6:]  # metrics.jsonl holds the lost launch's rows before them
        assert [r["step"] for r in resumed] == list(range(5, 11))
        assert [r["loss"] for r in resumed] == [expected[step] for step in range(5, 11)]
    assert [r["ft/params_digest"] for r in rows(again[0])[-6:]] == [r["ft/params_digest"] for r in rows(again[1])[-6:]]
    # Only the lowest live group saved; the control: group 0 did.
    assert not list((tmp_path / "lost" / "group1").glob("checkpoint/step-*"))
    assert list((tmp_path / "lost" / "group0").glob("checkpoint/step-*"))
