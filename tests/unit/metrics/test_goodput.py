"""The goodput ledger (titanlite/metrics/goodput.py) with the clock given: rank 0's interval
(goodput_clock.py), the launcher's rows (launcher/launch_ledger.py), a kill in the middle of a row, and
the line. The launches that fail and restart are in tests/runs/test_resilience.py."""

from __future__ import annotations

import json

import pytest

from titanlite.launcher import launch_ledger
from titanlite.launcher.launch_ledger import LaunchLedger
from titanlite.metrics import goodput, goodput_clock
from titanlite.metrics.goodput import (
    ATTEMPT_ENV,
    CATEGORIES,
    Attempt,
    Totals,
    append_row,
    ledger_path,
    read_rows,
    totals,
)
from titanlite.metrics.goodput_clock import GoodputClock

T0 = 1_700_000_000.0


class FakeTime:
    """`time.time` and `time.perf_counter` at `now` seconds after T0, moved by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def time(self) -> float:
        return T0 + self.now

    def perf_counter(self) -> float:
        return 1000.0 + self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(goodput_clock, "time", fake)
    monkeypatch.setattr(launch_ledger, "time", fake)
    return fake


def row(id_: str, start: float, end: float, step: int = 0, **seconds: float) -> dict:
    return {"id": id_, "start": start, "end": end, "seconds": seconds, "step": step}


def test_a_kill_in_the_middle_of_a_row_loses_that_row_and_counts_nothing_twice(tmp_path):
    """Rank 0 rewrites its growing interval under one id; a kill -9 mid-write leaves a torn last line.
    The next writer ends that line first, the reader skips it, and each id counts once, at its last row."""
    path = ledger_path(tmp_path)
    append_row(path, row("launch/launcher/0", T0, T0 + 5, startup=5))
    append_row(path, row("launch/rank0/0", T0 + 5, T0 + 8, step=1, startup=2, productive=1))
    append_row(path, row("launch/rank0/0", T0 + 5, T0 + 11, step=4, startup=2, productive=4))
    whole = json.dumps(row("launch/rank0/0", T0 + 5, T0 + 14, step=7, startup=2, productive=7))
    with open(path, "a") as f:  # killed half-way through the row
        f.write(whole[: len(whole) // 2])
    append_row(path, {"id": "damaged", "start": T0, "end": T0 + 1, "seconds": 5})  # valid JSON, not a row
    append_row(path, row("launch/launcher/1", T0 + 11, T0 + 20, step=7, restart=9))  # the launcher, next
    lines = path.read_text().splitlines()
    assert lines[3] == whole[: len(whole) // 2] and json.loads(lines[5])["id"] == "launch/launcher/1"
    rows = read_rows(path)
    assert [r["id"] for r in rows] == ["launch/launcher/0", *["launch/rank0/0"] * 2, "launch/launcher/1"]
    got = totals(rows)
    assert got.wall == 20  # [T0, T0 + 20] once: the rank's interval at its last whole row, no overlap
    assert (got.seconds["startup"], got.seconds["productive"], got.seconds["restart"]) == (7, 4, 9)
    assert got.goodput == pytest.approx(0.2)
    # Read twice, or with its rows repeated, the ledger says the same.
    assert totals(rows + rows) == got


def test_rank_0s_clock_splits_its_interval_with_nothing_left_out(tmp_path, monkeypatch, clock):
    """From the attempt's start (the launcher's spawn, 3 s before the trainer builds its clock): start-up,
    a checkpoint load, three steps with data waits and a save. The first step's time over the later
    steps' mean is compilation; the parts sum to the interval, whose end is the last mark."""
    monkeypatch.setenv(ATTEMPT_ENV, Attempt("launch", 0, T0).env())
    append_row(ledger_path(tmp_path), row("launch/launcher/0", T0 - 4, T0, startup=4))
    clock.now = 3.0
    gp = GoodputClock(str(tmp_path), enabled=True)
    assert gp.before.wall == 4 and gp.trained == 0
    gp.mark("startup")
    clock.sleep(1.0)
    gp.mark("checkpoint_load")
    for step, seconds in ((1, 5.0), (2, 1.0), (3, 1.0)):
        clock.sleep(0.5)
        gp.mark("data_wait")
        clock.sleep(seconds)
        gp.step_done(step)
    clock.sleep(2.0)
    gp.mark("checkpoint_save")
    clock.sleep(0.25)  # not marked yet: in no row
    parts = gp.snapshot()
    assert parts == {
        **dict.fromkeys(CATEGORIES, 0.0),
        "startup": 3.0,
        "checkpoint_load": 1.0,
        "data_wait": 1.5,
        "compile": 4.0,
        "productive": 3.0,
        "checkpoint_save": 2.0,
    }
    gp.flush()
    (written,) = [r for r in read_rows(gp.path) if r["id"] == "launch/rank0/0"]
    assert (written["start"], written["end"], written["step"]) == (T0, T0 + 14.5, 3)
    assert sum(written["seconds"].values()) == pytest.approx(written["end"] - written["start"])
    metrics = gp.metrics()
    assert metrics["goodput"] == pytest.approx(3.0 / 18.5)  # the launcher's 4 s and this interval
    assert metrics["badput/startup"] == 7.0 and metrics["badput/recompute"] == 0.0
    # Before a second step there is nothing to compare the first with: it counts as a step.
    monkeypatch.setenv(ATTEMPT_ENV, Attempt("launch", 1, T0 + 20).env())
    clock.now = 20.0
    one = GoodputClock(str(tmp_path), enabled=True)
    clock.sleep(5.0)
    one.step_done(4)
    assert one.snapshot()["productive"] == 5.0 and one.snapshot()["compile"] == 0.0


def test_steps_the_job_trained_before_are_recomputed(tmp_path, monkeypatch, clock):
    """After a failure at step 5 (the launcher's row carries the step rank 0 last finished), an attempt
    resumed from step 3 trains steps 4 and 5 again: their time is `recompute`, step 6's is productive."""
    path = ledger_path(tmp_path)
    append_row(path, row("launch/rank0/0", T0, T0 + 10, step=4, productive=10))
    append_row(path, row("launch/launcher/1", T0 + 10, T0 + 12, step=5, restart=2))
    monkeypatch.setenv(ATTEMPT_ENV, Attempt("launch", 1, T0 + 12).env())
    clock.now = 12.0
    gp = GoodputClock(str(tmp_path), enabled=True)
    assert gp.trained == 5
    for step, seconds in ((4, 3.0), (5, 1.0), (6, 1.0)):
        clock.sleep(seconds)
        gp.step_done(step)
    parts = gp.snapshot()
    assert (parts["compile"], parts["recompute"], parts["productive"]) == (2.0, 2.0, 1.0)
    assert gp.metrics()["badput/recompute"] == 2.0


def test_a_second_trainer_in_one_process_starts_where_the_first_ended(tmp_path, monkeypatch, clock):
    """Without titanlite's launcher an interval starts at the process's start, but never before the
    newest interval's end: two trainers one after the other in one process count its time once."""
    monkeypatch.delenv(ATTEMPT_ENV, raising=False)
    monkeypatch.setattr(goodput, "process_started", lambda: T0)
    clock.now = 3.0
    first = GoodputClock(str(tmp_path), enabled=True)
    clock.sleep(2.0)
    first.step_done(1)
    first.flush()
    clock.sleep(1.0)
    second = GoodputClock(str(tmp_path), enabled=True)
    clock.sleep(1.0)
    second.mark("startup")
    second.flush()
    assert totals(read_rows(ledger_path(tmp_path))).wall == 7.0  # [T0, T0 + 7] once


def test_the_launchers_rows_cover_what_rank_0_does_not_and_end_in_the_line(tmp_path, monkeypatch, clock):
    """The launch's start to the first spawn (start-up); the failed attempt's last row to the next spawn
    (restart, with the step rank 0 last finished); the last row to the launch's end. With rank 0's rows,
    they tile the launch: the line's total is its wall time."""
    ledger = LaunchLedger(str(tmp_path), started=T0)
    clock.now = 4.0
    env = ledger.attempt(True, None)
    assert env == {ATTEMPT_ENV: f"{ledger.launch} 0 {T0 + 4:.6f}"}
    monkeypatch.setenv(ATTEMPT_ENV, env[ATTEMPT_ENV])
    gp = GoodputClock(str(tmp_path), enabled=True)
    clock.sleep(6.0)
    gp.mark("startup")
    clock.sleep(2.0)
    gp.step_done(1)
    gp.flush()
    clock.sleep(3.0)  # the failure: no row of rank 0 any more
    monkeypatch.setenv(ATTEMPT_ENV, ledger.attempt(True, 2)[ATTEMPT_ENV])
    gp = GoodputClock(str(tmp_path), enabled=True)
    assert gp.trained == 2
    clock.sleep(5.0)
    gp.mark("startup")
    clock.sleep(1.0)
    gp.step_done(2)
    gp.flush()
    clock.sleep(0.5)
    line = ledger.end(0, 2)
    rows = read_rows(ledger.path)
    spans = sorted((r["start"], r["end"]) for r in {r["id"]: r for r in rows}.values())
    assert spans == [(T0, T0 + 4), (T0 + 4, T0 + 12), (T0 + 12, T0 + 15), (T0 + 15, T0 + 21), (T0 + 21, T0 + 21.5)]
    assert [r["step"] for r in rows if r["id"] == f"{ledger.launch}/launcher/1"] == [2]
    assert line == (
        "goodput 9.3% of 22 s: startup 15.0 s, compile 0.0 s, checkpoint_load 0.0 s, checkpoint_save 0.0 s, "
        f"data_wait 0.0 s, recompute 1.0 s, restart 3.0 s, other 0.5 s (ledger {ledger.path})"
    )


def test_a_launch_ending_in_bad_input_prints_no_line_and_withdraws_rows_no_rank_0_joined(tmp_path, clock):
    """A second launch into a dump folder in use fails with exit code 2 before its rank 0 records anything:
    its rows are withdrawn (its time overlaps the running launch's). With rank 0's rows, they stay."""
    ledger = LaunchLedger(str(tmp_path), started=T0)
    clock.now = 4.0
    ledger.attempt(True, None)
    clock.sleep(1.0)
    assert ledger.end(2, None) is None
    assert totals(read_rows(ledger.path)).wall == 0
    other = LaunchLedger(str(tmp_path / "b"), started=T0)
    other.attempt(True, None)
    append_row(other.path, row(f"{other.launch}/rank0/0", T0 + 5, T0 + 5.5, startup=0.5))
    clock.sleep(1.0)
    assert other.end(2, None) is None
    assert totals(read_rows(other.path)).wall == 6


def test_a_node_without_rank_0_writes_nothing_and_prints_no_line(tmp_path, clock):
    ledger = LaunchLedger(str(tmp_path), started=T0)
    assert ledger.attempt(False, None) == {}
    assert ledger.end(1, None) is None and not ledger.path.exists()


def test_the_line_when_the_ledger_cannot_be_written(tmp_path, clock):
    (tmp_path / "dump").write_text("")  # a file where the dump folder should be
    ledger = LaunchLedger(str(tmp_path / "dump"), started=T0)
    clock.now = 2.0
    ledger.attempt(True, None)
    line = ledger.end(1, None)
    assert line is not None and line.startswith("goodput 0.0% of 2 s: startup 2.0 s, ")
    assert line.endswith(
        f"(ledger {ledger.path} not written: FileExistsError: [Errno 17] File exists: '{tmp_path / 'dump'}')"
    )


def test_totals_report_nothing_as_no_goodput():
    assert Totals.zero().goodput == 0.0 and Totals.zero().metrics()["goodput"] == 0.0
