"""Fault injection: preemption (and determinism), a crashed rank with restarts, a hung rank (stopped from
outside, or stuck in Python) caught by the launcher's watchdog, non-finite losses.

Faults come from the test-only TITANLITE_FAULT_* environment variables (titanlite/faults.py).
Runs use the debug model cut to 2 blocks, with seq_len 64 and metrics every step, so each is a few seconds.
The goodput ledger of these launches (the line, metrics and parts against each launch's wall time) is
checked here too; the ledger's own logic with the clock given is tests/unit/metrics/test_goodput.py's.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness import (
    GOODPUT_LINE,
    SHALLOW,
    SMALL,
    RunResult,
    child_env,
    launcher_lines,
    rank_pid,
    start_launch,
    threads,
    train,
)
from titanlite.metrics.goodput import BADPUT, Totals, ledger_path, read_rows, totals


def run(dump: Path, *overrides: str, nproc: int = 2, launcher: str = "torchrun", **env: str) -> RunResult:
    return train(dump, nproc, *SMALL, *SHALLOW, *overrides, launcher=launcher, env=env)


def losses(dump: Path) -> dict[int, float]:
    out = {}
    for line in (dump / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[r["step"]] = r["loss"]
    return out


CHECKPOINTED = ("--checkpoint.enable", "--checkpoint.interval", "100", "--training.steps", "8")
RESTARTING = ("--training.steps", "8", "--checkpoint.enable", "--checkpoint.interval", "2", "--comm.max_restarts", "1")
WATCHED = ("--comm.hang_timeout_seconds", "5")
"""A window the tests can wait for; the fault-free 100-step run shows it never fires on healthy steps."""


def run_stopping_a_rank(dump: Path, step: int, *overrides: str, rank: int = 1, every: float | None = None) -> RunResult:
    """run_train.sh on 2 ranks; once metrics.jsonl holds `step` rows, rank `rank` is stopped from outside
    (SIGSTOP, as a stuck process or a debugger leaves it); with `every`, for two thirds of every `every`
    seconds until the run ends (SIGCONT between: a rank slowed by something outside it). The rank's pid is
    found while it starts, so the stop lands within a poll of the step, however loaded the machine."""
    args = ["--config", "train_configs/debug_model.toml", "--job.dump_folder", str(dump), *SMALL, *SHALLOW, *overrides]
    env = child_env(NGPU="2", OMP_NUM_THREADS=str(threads(2)))
    out_file, err_file = dump.with_name(f"{dump.name}.out"), dump.with_name(f"{dump.name}.err")
    with open(out_file, "w") as out, open(err_file, "w") as err:  # files: a full pipe would block the run
        proc = start_launch(args, env, stdout=out, stderr=err)
    metrics, deadline, pid = dump / "metrics.jsonl", time.monotonic() + 300, None
    while not (pid and metrics.exists() and len(metrics.read_text().splitlines()) >= step):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before the step"
        pid = pid or rank_pid(dump, rank)
        time.sleep(0.02)
    os.kill(pid, signal.SIGSTOP)
    while every is not None and proc.poll() is None:
        time.sleep(every * 2 / 3)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        time.sleep(every / 3)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    proc.wait(timeout=300)  # a stopped rank stays stopped until the launcher continues or kills it
    out, err = out_file.read_text(), err_file.read_text()
    return RunResult(proc.returncode, out, err, dump)


@dataclass
class Launches:
    """One dump folder's launches, one after another: each launch's result, the losses metrics.jsonl
    held right after it and its wall time by the test's own clock (around the launch's process)."""

    dump: Path
    procs: list[RunResult]
    losses: list[dict[int, float]]
    walls: list[float]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Launches]:
    """Every launch of the module, two dump folders at a time (a launch's start-up keeps about one core
    busy)."""
    root = tmp_path_factory.mktemp("resilience")

    def launches(name: str, *steps: tuple[tuple[str, ...], dict]) -> Launches:
        """(overrides, `run`'s keywords) of each launch."""
        out = Launches(root / name, [], [], [])
        out.dump.mkdir()
        for overrides, kwargs in steps:
            started = time.monotonic()
            out.procs.append(run(out.dump, *overrides, **kwargs))
            out.walls.append(time.monotonic() - started)
            metrics = out.dump / "metrics.jsonl"
            out.losses.append(losses(out.dump) if metrics.exists() else {})
        return out

    crash = {"TITANLITE_FAULT_EXIT_AT": "6", "TITANLITE_FAULT_RANK": "1", "LOG_RANK": "0,1"}
    hang = {"TITANLITE_FAULT_HANG_AT": "6", "TITANLITE_FAULT_RANK": "1", "launcher": "run_train"}
    plans = {
        "uninterrupted": [(("--training.steps", "8"), {})],
        # SIGTERM at step 4 on rank 1, then the resume in the same folder.
        "sigterm": [
            (CHECKPOINTED, {"TITANLITE_FAULT_SIGTERM_AT": "4", "TITANLITE_FAULT_RANK": "1"}),
            (CHECKPOINTED, {}),
        ],
        # Rank 1 exits at step 6 once (the marker file is written in the dump folder), with one restart.
        "crash": [
            (RESTARTING, {"launcher": "run_train", "TITANLITE_FAULT_ONCE": str(root / "crash" / "fired"), **crash})
        ],
        # Rank 1 hangs in Python before step 6 once; the watchdog restarts every rank.
        "hang": [(RESTARTING + WATCHED, {"TITANLITE_FAULT_ONCE": str(root / "hang" / "fired"), **hang})],
        # The same with no restart left: the launch ends with the hang's code.
        "hang_final": [(("--training.steps", "3", *WATCHED), {**hang, "TITANLITE_FAULT_HANG_AT": "2"})],
        # A healthy run of 100 steps, with saves, under the same window.
        "watched": [
            (
                ("--training.steps", "100", "--checkpoint.enable", "--checkpoint.interval", "40", *WATCHED)
                + ("--metrics.log_freq", "10"),  # as by default
                {"launcher": "run_train"},
            )
        ],
        "nan_stop": [
            (
                ("--training.steps", "8", "--checkpoint.enable", "--checkpoint.interval", "2"),
                {"nproc": 1, "TITANLITE_FAULT_NAN_AT": "5"},
            )
        ],
        "nan_skip": [
            (("--training.steps", "6", "--training.skip_nonfinite_steps", "1"), {"TITANLITE_FAULT_NAN_AT": "3"})
        ],
    }

    def stopped(name: str) -> Launches:
        """Rank 1 stopped from outside after step 1, with one restart."""
        dump = root / name
        dump.mkdir()
        started = time.monotonic()
        result = run_stopping_a_rank(dump, 1, *RESTARTING, *WATCHED)
        return Launches(dump, [result], [losses(dump)], [time.monotonic() - started])

    def slowed(name: str) -> Launches:
        """Rank 1 stopped for two thirds of every half second from its first logged step on."""
        dump = root / name
        dump.mkdir()
        started = time.monotonic()
        result = run_stopping_a_rank(dump, 1, "--training.steps", "40", "--metrics.log_freq", "5", every=0.5)
        return Launches(dump, [result], [losses(dump)], [time.monotonic() - started])

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(launches, name, *steps) for name, steps in plans.items()}
        futures["stopped"] = pool.submit(stopped, "stopped")
        futures["slowed"] = pool.submit(slowed, "slowed")
        return {name: future.result() for name, future in futures.items()}


@pytest.fixture(scope="module")
def uninterrupted(runs) -> dict[int, float]:
    (proc,) = runs["uninterrupted"].procs
    assert proc.returncode == 0, proc.stderr[-3000:]
    return runs["uninterrupted"].losses[0]


@pytest.mark.slow
def test_sigterm_saves_and_resumes_exactly(runs, uninterrupted):
    """Steps 1-4 before the signal equal the uninterrupted run bitwise (two runs are deterministic), and
    so do steps 5-8 after the resume."""
    sigterm = runs["sigterm"]
    stopped, resumed = sigterm.procs
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    out = stopped.stdout + stopped.stderr
    assert "stop signal (SIGTERM) at step 4: checkpoint saved to" in out
    assert (sigterm.dump / "checkpoint" / "step-4").is_dir()
    assert sigterm.losses[0] == {s: uninterrupted[s] for s in range(1, 5)}  # exact float equality
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sigterm.losses[1] == uninterrupted


@pytest.mark.slow
def test_crashed_rank_restarts_from_checkpoint(runs, uninterrupted):
    """run_train.sh passes comm.max_restarts to the launcher; the job comes back from the last checkpoint."""
    dump, (proc,) = runs["crash"].dump, runs["crash"].procs
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert (dump / "fired").exists()
    got = losses(dump)  # the log holds steps 1-5 of the first attempt, then 5-8 after the restart
    assert got[8] == uninterrupted[8]
    # The restart is announced once, with its cause, and the launch ends with the goodput line;
    # metrics.jsonl tells the two runs' rows apart.
    own = launcher_lines(proc.stderr)
    assert own == [
        "titanlite: restarting every rank (restart 1 of 1) after: rank 1 exited with code 17 (the ranks' "
        "logs are in " + own[0].split("logs are in ")[-1]
    ], own
    assert GOODPUT_LINE.fullmatch(proc.stderr.splitlines()[-1]), proc.stderr[-2000:]
    runs_ = [(r["run"], r["step"]) for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())]
    assert runs_ == [(1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (2, 5), (2, 6), (2, 7), (2, 8)], runs_


def ledger_of(launches: Launches) -> Totals:
    return totals(read_rows(ledger_path(launches.dump)))


def assert_the_line_is_the_ledgers(proc: RunResult, dump: Path) -> Totals:
    """The launch's last line is the goodput line, and says what the dump folder's ledger holds."""
    line = proc.stderr.splitlines()[-1]
    match = GOODPUT_LINE.fullmatch(line)
    assert match and match["ledger"] == str(ledger_path(dump)) and not match["unwritten"], proc.stderr[-3000:]
    ledger = totals(read_rows(ledger_path(dump)))
    assert float(match["pct"]) == pytest.approx(100 * ledger.goodput, abs=0.051), line
    assert int(match["wall"]) == pytest.approx(ledger.wall, abs=0.51), line
    assert all(float(match[c.name]) == pytest.approx(ledger.seconds[c.name], abs=0.051) for c in BADPUT), line
    return ledger


@pytest.mark.slow
@pytest.mark.parametrize("case", ["crash", "watched"])
def test_the_goodput_parts_sum_to_the_launchs_wall_time(runs, case):
    """The ledger's parts (productive steps and every badput category), summed, are the launch's wall time
    by the test's own clock around run_train.sh, within 5%: after a failure and a restart (the crash)
    and for a healthy 100-step run with saves (watched). The line at the launch's end says the same."""
    launches = runs[case]
    (proc,), (wall,) = launches.procs, launches.walls
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    ledger = assert_the_line_is_the_ledgers(proc, launches.dump)
    assert ledger.wall == pytest.approx(wall, rel=0.05), (ledger, wall)
    assert ledger.seconds["productive"] > 0 and ledger.seconds["startup"] > 0 and ledger.seconds["checkpoint_save"] > 0


@pytest.mark.slow
def test_goodput_after_a_restart_counts_the_recomputed_steps_and_the_restart(runs):
    """Rank 1 exits at step 6 and the restart resumes from step 4's checkpoint: step 5, trained again, is
    recompute badput, the restart and the second load are counted, and metrics.jsonl's rows carry the
    job's goodput and badput so far (run 2's rows with the recomputed step, run 1's without)."""
    crash = runs["crash"]
    ledger = ledger_of(crash)
    assert ledger.seconds["recompute"] > 0 and ledger.seconds["restart"] > 0, ledger
    assert ledger.seconds["checkpoint_load"] > 0, ledger
    rows = [json.loads(line) for line in (crash.dump / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < r["goodput"] < 1 and all(f"badput/{c.name}" in r for c in BADPUT) for r in rows), rows
    assert [(r["run"], r["badput/recompute"] > 0) for r in rows] == [(1, False)] * 5 + [(2, True)] * 4, rows
    assert rows[-1]["badput/recompute"] == pytest.approx(ledger.seconds["recompute"], abs=1e-3)
    assert all(rows[-1][f"badput/{c}"] <= ledger.seconds[c] + 1e-3 for c in ("startup", "restart", "data_wait"))


@pytest.mark.slow
def test_a_run_that_never_trains_a_step_twice_has_no_recompute_badput(runs):
    """The negative control of the test above: the healthy 100-step run (run_train.sh), the uninterrupted
    8 steps (torchrun: rank 0's ledger alone, no launcher rows) and a resume from the step a stop signal
    saved (the second launch of the same dump folder) train no step twice."""
    for case in ("watched", "uninterrupted", "sigterm"):
        ledger = ledger_of(runs[case])
        assert ledger.seconds["recompute"] == 0 and ledger.seconds["productive"] > 0, (case, ledger)
        rows = [json.loads(line) for line in (runs[case].dump / "metrics.jsonl").read_text().splitlines()]
        assert rows and all(r["badput/recompute"] == 0 for r in rows), (case, rows)
    assert ledger_of(runs["watched"]).seconds["restart"] == 0
    assert not GOODPUT_LINE.search(runs["uninterrupted"].procs[0].stderr)  # torchrun prints none


HUNG = (
    r"rank 1{how} made no progress for \d+ s (at step \d+|in the checkpoint after step \d+); "
    r"rank 0 was waiting in a collective; "
    r"stacks in (.*)/hang/0/"
)


def own_lines(proc: RunResult) -> list[str]:
    """What the launcher itself printed (not the ranks' log lines), less its goodput line."""
    return launcher_lines(proc.stderr)


@pytest.mark.slow
@pytest.mark.parametrize(("case", "how", "frame"), [("stopped", " (a stopped process)", ""), ("hang", "", "faults.py")])
def test_a_hung_rank_is_named_its_stacks_written_and_the_run_restarted_exactly(runs, uninterrupted, case, how, frame):
    """A rank stopped from outside (SIGSTOP) or stuck in Python: the launcher's watchdog names it and the
    step in one line, writes every rank's Python stacks, restarts every rank from the last checkpoint, and
    the run finishes with the uninterrupted run's losses, bitwise."""
    dump, (proc,) = runs[case].dump, runs[case].procs
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    (line,) = own_lines(proc)
    match = re.fullmatch(
        "titanlite: restarting every rank \\(restart 1 of 1\\) after: " + HUNG.format(how=re.escape(how)), line
    )
    assert match, line
    # The in-Python hang is before step 6; the stop lands wherever rank 1 was after step 1, before step 8.
    assert match[1] == "at step 6" if case == "hang" else 2 <= int(match[1].split()[-1]) <= 8, line
    assert match[2] == str(dump)
    stuck, waiting = ((dump / "hang" / "0" / f"rank{r}.txt").read_text() for r in (1, 0))
    assert stuck.startswith("rank 1, pid ") and ("stopped (SIGSTOP)" in stuck) == (case == "stopped"), stuck
    assert 'File "' in stuck and frame in stuck, stuck
    assert "torch/distributed/" in waiting or "torch/autograd/" in waiting, waiting
    assert losses(dump) == uninterrupted  # the restart's rows replace steps 5-8 of the first attempt
    assert [r["run"] for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())][-1] == 2
    # The hang's window (5 s, less the logging after the step) is in the restart's badput, the launch's
    # wall time in the ledger's parts.
    ledger = assert_the_line_is_the_ledgers(proc, dump)
    assert ledger.seconds["restart"] > 4 and ledger.wall == pytest.approx(runs[case].walls[0], rel=0.05), ledger


@pytest.mark.slow
def test_a_hang_with_no_restart_left_exits_5_in_one_line(runs):
    (proc,) = runs["hang_final"].procs
    assert proc.returncode == 5, (proc.stdout + proc.stderr)[-4000:]
    (line,) = own_lines(proc)
    match = re.fullmatch("titanlite: error: " + HUNG.format(how=""), line)
    assert match and match[1] == "at step 2", line
    # A failed launch ends with the goodput line too: the hang's window is the failure's badput.
    assert assert_the_line_is_the_ledgers(proc, runs["hang_final"].dump).seconds["restart"] > 4


@pytest.mark.slow
def test_the_watchdog_never_fires_on_a_healthy_run(runs):
    """100 steps with two saves, under the same 5-second window as the hangs above."""
    dump, (proc,) = runs["watched"].dump, runs["watched"].procs
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert not (dump / "hang").exists() and "made no progress" not in proc.stderr
    assert max(runs["watched"].losses[0]) == 100


@pytest.mark.slow
def test_a_rank_slowed_from_outside_is_named_the_straggler(runs):
    """Rank 1 stopped two thirds of the time: its peers wait for it in every collective, so every rank's step
    takes as long; the time each spent not waiting names rank 1 within 30 steps, in the log and metrics."""
    dump, (proc,) = runs["slowed"].dump, runs["slowed"].procs
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    named = re.findall(r"straggler at step (\d+): rank (\d+) is ([\d.]+)x slower", proc.stderr)
    # Named once a streak (a streak broken by a window the stops missed starts a new one): rank 1 only.
    assert named and int(named[0][0]) <= 30 and {rank for _, rank, _ in named} == {"1"}, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    slowest = [r["straggler/slowest_rank"] for r in rows if r["step"] >= 10]
    assert slowest.count(1) >= len(slowest) - 1, rows


@pytest.mark.slow
def test_a_healthy_run_names_no_straggler(runs):
    """The negative control of the test above: the same measure on the healthy 100-step run."""
    dump, (proc,) = runs["watched"].dump, runs["watched"].procs
    assert "straggler at step" not in proc.stderr
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert all("straggler/ratio" in r and r["straggler/slowest_rank"] in (0, 1) for r in rows), rows


@pytest.mark.slow
def test_nan_stops_with_last_good_checkpoint(runs):
    dump, (proc,) = runs["nan_stop"].dump, runs["nan_stop"].procs
    assert proc.returncode != 0
    err = [ln for ln in proc.stderr.splitlines() if "titanlite: error:" in ln]
    assert err and "non-finite step 5" in err[0] and "step-4" in err[0]
    # the checkpoint on disk is the last good one
    assert sorted(p.name for p in (dump / "checkpoint").iterdir() if p.name.startswith("step-")) == [
        "step-2",
        "step-4",
    ]


@pytest.mark.slow
def test_nan_step_is_skipped_within_limit(runs, uninterrupted):
    (proc,) = runs["nan_skip"].procs
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = runs["nan_skip"].losses[0]
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
    from titanlite.planning.run_plan import RunPlan
    from titanlite.run.trainer import Trainer

    cfg = config(
        tmp_path, training__seq_len=8, training__local_batch_size=2, training__steps=4, checkpoint__enable=True
    )
    stop = _StopAt(2)
    trainer = Trainer(cfg, RunPlan.build(cfg, 1, args=tiny_args(vocab_size=2056)), preemption=stop)
    step, enabled_in_step = trainer.train_step, []

    def train_step(batches, context):
        enabled_in_step.append(gc.isenabled())
        if trainer.step == stop.at:
            if ending == "error":
                raise RuntimeError("a failing step")
            stop.received = signal.SIGTERM
        return step(batches, context)

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


def test_the_step_faults_are_read_once_and_fire_only_where_asked(tmp_path, monkeypatch):
    """`StepFaults` reads the environment when the loop starts: a rank fault fires on the faulting rank
    alone, once per ONCE file; NAN_AT poisons the loss of its steps only (the same function otherwise);
    a later change of the environment does not reach a loop already running."""
    from titanlite.errors import UserError
    from titanlite.faults import StepFaults

    monkeypatch.setenv("TITANLITE_FAULT_USER_ERROR_AT", "2")
    monkeypatch.setenv("TITANLITE_FAULT_RANK", "1")
    monkeypatch.setenv("TITANLITE_FAULT_ONCE", str(tmp_path / "fired"))
    monkeypatch.setenv("TITANLITE_FAULT_NAN_AT", "3,5")
    faulting, other = StepFaults.from_env(1), StepFaults.from_env(0)
    monkeypatch.setenv("TITANLITE_FAULT_USER_ERROR_AT", "1")
    faulting.before_step(1)
    other.before_step(2)
    with pytest.raises(UserError, match="fault injection: rank 1 found bad input at step 2"):
        faulting.before_step(2)
    faulting.before_step(2)  # the ONCE file exists now: a restarted run goes on
    assert (tmp_path / "fired").exists()

    def loss(pred, labels):
        return pred - labels

    assert faulting.nan_loss(2, loss) is loss and other.nan_loss(4, loss) is loss
    assert math.isnan(other.nan_loss(5, loss)(2.0, 1.0))
