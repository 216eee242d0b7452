"""The hang watchdog's window (titanlite/launcher/hang_watchdog.py) over the progress files ranks write
(titanlite/run/progress.py), with the clock given: when it is armed, how it stretches with slow
steps and during saves, and the line it prints. The launches that hang are in tests/runs/test_resilience.py."""

from __future__ import annotations

from pathlib import Path

from titanlite.launcher.hang_watchdog import Hang, HangWatchdog
from titanlite.run.progress import PROGRESS_DIR_ENV, Progress


def beat(folder: Path, monkeypatch, rank: int, step: int, phase: str = "train") -> None:
    monkeypatch.setenv(PROGRESS_DIR_ENV, str(folder))
    progress = Progress(rank)
    progress.beat(step, phase)  # type: ignore[arg-type]
    progress.close()


def test_armed_by_the_first_step_then_fires_after_the_window(tmp_path, monkeypatch):
    dog = HangWatchdog(tmp_path, timeout=5, relaxed_timeout=300, dump_folder=str(tmp_path))
    assert dog.idle([0, 1], now=0) is None and dog.idle([0, 1], now=1000) is None  # start-up: not armed
    beat(tmp_path, monkeypatch, 0, 1)
    assert dog.idle([0, 1], now=1000) is None  # the first record arms it
    assert dog.idle([0, 1], now=1004.9) is None
    assert dog.idle([0, 1], now=1005) == 5


def test_the_window_stretches_to_three_times_the_longest_step(tmp_path, monkeypatch):
    dog = HangWatchdog(tmp_path, timeout=5, relaxed_timeout=300, dump_folder=str(tmp_path))
    beat(tmp_path, monkeypatch, 0, 1)
    dog.idle([0], now=0)
    beat(tmp_path, monkeypatch, 0, 2)
    dog.idle([0], now=4)  # a 4-second step: the window is now 12 s
    assert dog.idle([0], now=15.9) is None
    assert dog.idle([0], now=16) == 12


def test_a_save_or_validation_waits_for_the_relaxed_window(tmp_path, monkeypatch):
    dog = HangWatchdog(tmp_path, timeout=5, relaxed_timeout=300, dump_folder=str(tmp_path))
    beat(tmp_path, monkeypatch, 0, 1)
    dog.idle([0, 1], now=0)
    beat(tmp_path, monkeypatch, 1, 2, "checkpoint")
    dog.idle([0, 1], now=1)
    assert dog.idle([0, 1], now=200) is None
    assert dog.idle([0, 1], now=301) == 300
    # The save's length is no step's: back in training, the window is 5 s again.
    beat(tmp_path, monkeypatch, 1, 2)
    dog.idle([0, 1], now=400)
    assert dog.idle([0, 1], now=405) == 5


def test_a_new_attempt_forgets_the_last_and_is_disarmed(tmp_path, monkeypatch):
    dog = HangWatchdog(tmp_path, timeout=5, relaxed_timeout=300, dump_folder=str(tmp_path))
    beat(tmp_path, monkeypatch, 0, 7)
    dog.idle([0], now=0)
    dog.reset()
    assert not list(tmp_path.glob("rank*")) and dog.idle([0], now=100) is None


def test_the_line_names_the_stuck_and_the_waiting_ranks(tmp_path):
    folder = tmp_path / "hang" / "0"
    stopped = Hang(30.4, "at step 23", stuck=[1], stopped=[1], waiting=[0, 2, 3], folder=folder)
    assert stopped.line() == (
        f"rank 1 (a stopped process) made no progress for 30 s at step 23; ranks 0, 2, 3 were waiting in a "
        f"collective; stacks in {folder}/"
    )
    elsewhere = Hang(30, "at step 23", stuck=[], stopped=[], waiting=[0, 1], folder=folder)
    assert elsewhere.line() == (
        "ranks 0, 1 were waiting in a collective for 30 s at step 23 (the rank that stopped is on another node); "
        f"stacks in {folder}/"
    )
    all_stuck = Hang(30, "in the validation after step 9", stuck=[0, 1], stopped=[], waiting=[], folder=folder)
    assert (
        all_stuck.line() == f"ranks 0, 1 made no progress for 30 s in the validation after step 9; stacks in {folder}/"
    )
