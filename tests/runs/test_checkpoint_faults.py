"""Checkpoints under faults, as users meet them: through `run_train.sh` (NGPU=1: the preflight, the
launcher and one rank; exit codes and error lines are what the launcher reports): a full disk under the
metrics and the checkpoints (the last save failing: exit code 4), a full disk during an async save, a
stop signal whose save fails under a file size limit, a slow deletion of an old checkpoint (two ranks)
and a stop signal during one, a second run on a locked dump folder, a bit flip in a shard (resume and
HF export), a resume with changed settings or nothing to train.

The full disk is a real one where this process may mount a 4 MiB tmpfs (root); elsewhere a 4 MiB file
size limit (RLIMIT_FSIZE, inherited by the trainer) makes the same DCP write fail (EFBIG). Either way
torch's file writer reports a short write (a RuntimeError); on the tmpfs the warning also shows 0 MiB free.
The in-process variants (injected write faults, the lock's holder dying, every settings rule) are in
test_checkpoint.py.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harness import (
    GOODPUT_LINE,
    ROOT,
    SHALLOW,
    SMALL,
    RunResult,
    assert_resumed,
    child_env,
    launcher_lines,
    preflight,
    start_launch,
    train,
)
from titanlite.checkpoint import folders
from titanlite.checkpoint.lock import DumpFolderLock
from titanlite.run.optimizer import lr_factor

pytestmark = pytest.mark.slow

DISK = 4 << 20  # far below one debug-model checkpoint (70 MB)
BASE = [*SMALL, "--training.local_batch_size", "2", "--checkpoint.enable", "--checkpoint.interval", "1"]


def run(dump: Path, *overrides: str, steps: int = 2) -> RunResult:
    return train(dump, 1, *BASE, "--training.steps", str(steps), *overrides, launcher="run_train")


def error_lines(proc: RunResult) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("titanlite: error:")]


def flip_a_bit(path: Path) -> None:
    """Flip one bit in the middle of `path` (same size: only a checksum can tell)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


# --- a full disk ------------------------------------------------------------------------------------------


@pytest.fixture
def full_disk(tmp_path) -> Iterator[tuple[Path, str]]:
    """(a checkpoint folder on a 4 MiB disk, what the warning says about it)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", str(mount)], capture_output=True)
    if mounted.returncode == 0:
        try:
            yield (
                mount / "checkpoint",
                f"the disk under {mount / 'checkpoint'} is full (0 MiB free; RuntimeError on rank 0: ",
            )
        finally:
            subprocess.run(["umount", str(mount)], check=True)
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (DISK, hard))  # inherited by the trainer started next
    try:
        yield mount / "checkpoint", "RuntimeError on rank 0"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def _assert_nothing_left(folder: Path) -> None:
    assert not folder.exists() or list(folder.iterdir()) == [], list(folder.iterdir())
    disk = os.statvfs(folder.parent)
    if disk.f_blocks * disk.f_frsize <= DISK:  # the tmpfs: its space is free again
        assert disk.f_bfree == disk.f_blocks


@pytest.fixture
def full_dump_disk(tmp_path) -> Iterator[tuple[Path, dict[str, str], str]]:
    """(a dump folder on a disk with one free page, for the lock file: every output and checkpoint
    write fails; the trainer's extra environment; what the save failure says about it). Where no disk
    can be mounted, the metrics' full-disk hook and a 4 MiB file size limit stand in."""
    mount = tmp_path / "disk"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if mounted.returncode == 0:
        try:
            disk = os.statvfs(mount)
            (mount / "filler").write_bytes(b"\0" * ((disk.f_bavail - 1) * disk.f_frsize))
            yield (
                mount / "run",
                {},
                f"the disk under {mount / 'run' / 'checkpoint'} is full "
                "(0 MiB free; OSError: [Errno 28] No space left on device)",
            )
        finally:
            subprocess.run(["umount", str(mount)], check=True)
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (DISK, hard))
    try:
        yield mount / "run", {"TITANLITE_FAULT_METRICS_DISK_FULL": "1"}, "(the file size limit (ulimit -f) is 4 MiB"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_full_disk_warns_once_per_output_and_a_failed_final_save_exits_4(full_dump_disk):
    """Metrics, TensorBoard events and checkpoints on a full disk: one warning per output, training goes
    on, and the run's last save failing ends it with exit code 4 and one line, not a success."""
    dump, env, cause = full_dump_disk
    proc = train(dump, 1, *BASE, "--training.steps", "2", "--metrics.enable_tensorboard", launcher="run_train", env=env)
    assert proc.returncode == 4, proc.log[-3000:]
    lines = proc.stderr.splitlines()
    # TensorBoard's events are written on the training thread: no traceback of a writer thread.
    assert not [line for line in lines if "Traceback" in line or "Exception in thread" in line], proc.stderr
    warned = [line.split(" WARNING ", 1)[1] for line in lines if " WARNING " in line]
    # The run's entry in runs.jsonl, TensorBoard's events and the goodput ledger's row at its start,
    # metrics.jsonl's at step 1.
    assert [w.split(" (")[0] for w in warned[:4]] == [
        "metrics: cannot write runs.jsonl",
        "metrics: cannot write TensorBoard events",
        "metrics: cannot write goodput.jsonl",
        "metrics: cannot write metrics.jsonl",
    ], warned
    assert len(warned) == 5 and warned[4].startswith(f"checkpoint step 1 could not be saved to {dump}/checkpoint")
    assert cause in warned[4] and all("training continues" in w for w in warned), warned
    (line,) = launcher_lines(proc.stderr)
    assert GOODPUT_LINE.fullmatch(proc.stderr.splitlines()[-1]), proc.stderr[-3000:]  # after the error
    assert line.startswith("titanlite: error: training finished at step 2, but checkpoint step 2 could not be saved")
    assert line.endswith("; no checkpoint was saved") and cause in line, line
    assert (dump / "metrics.jsonl").read_text() == ""  # no torn row
    assert list((dump / "checkpoint").iterdir()) == []  # no partial folder


def test_disk_full_during_an_async_save_stops_with_stop_on_save_error(tmp_path, full_disk):
    folder, cause = full_disk
    proc = run(
        tmp_path / "run",
        "--checkpoint.folder",
        str(folder),
        "--checkpoint.async_mode",
        "async",
        "--checkpoint.stop_on_save_error",
    )
    assert proc.returncode == 4, proc.log[-3000:]
    (line,) = error_lines(proc)
    assert "checkpoint step 1 could not be saved" in line and cause in line, line
    _assert_nothing_left(folder)


def test_a_stop_signal_whose_save_fails_exits_4_naming_the_file_size_limit(tmp_path):
    """SIGTERM at step 1 under `ulimit -f` 4 MiB: the stop's save fails (torch reports a short write), the
    line names the limit and the last good checkpoint, exit code 4. The data's warnings (a skipped .csv,
    a JSON array) are printed once, by the launcher, not again by the rank."""
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(ROOT / "titanlite" / "data" / "corpus" / "pydocs_000.txt", data)
    (data / "notes.csv").write_text("a,b\n")
    (data / "array.json").write_text('[{"text": "one"},\n {"text": "two"}]\n')
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (DISK, hard))  # inherited by the run started next
    try:
        proc = train(
            tmp_path / "run",
            1,
            *BASE,
            *("--training.steps", "3", "--checkpoint.interval", "100", "--training.dataset_path", str(data)),
            launcher="run_train",
            env={"TITANLITE_FAULT_SIGTERM_AT": "1"},
        )
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert proc.returncode == 4, proc.log[-3000:]
    own = launcher_lines(proc.stderr)
    assert len(own) == 3 and own[0].startswith("titanlite: warning: data: skipped 1 .csv file in"), own
    assert own[1].startswith(f"titanlite: warning: data: {data}/array.json: skipped 2 lines with invalid JSON")
    assert "JSON Lines is expected" in own[1] and "data:" not in proc.stdout + " ".join(
        line for line in proc.stderr.splitlines() if line.startswith("[rank") and "WARNING" in line
    )
    line = own[2]
    assert line.startswith(
        "titanlite: error: stop signal (SIGTERM) at step 1, but checkpoint step 1 could not be saved"
    )
    assert "(the file size limit (ulimit -f) is 4 MiB: no file may grow past it" in line
    assert line.endswith("; no checkpoint was saved"), line
    assert "checkpoint saved" not in proc.log and "training continues" not in proc.log


# --- a slow deletion of an old checkpoint ----------------------------------------------------------------


def test_a_slow_deletion_of_an_old_checkpoint_delays_no_step_and_ends_before_the_run(tmp_path):
    """Two ranks through run_train.sh; deleting a checkpoint takes 6 s (as terabytes on a shared file
    system take minutes) and a collective times out after 3 s (comm.train_timeout_seconds). Rank 0 deletes
    in the background: step 5, right after step-2 is pruned, takes no longer than the others (on rank 0's
    training thread, rank 1's next collective would time out); step-4, due while step-2 is still being
    deleted, is retired only at the end; the run waits for both deletions and exits 0 with step-5 alone."""
    delay = 6
    result = train(
        tmp_path,
        2,
        *BASE,
        "--checkpoint.interval",
        "2",
        "--checkpoint.keep_latest_k",
        "1",
        "--training.steps",
        "5",
        "--comm.train_timeout_seconds",
        "3",
        launcher="run_train",
        env={"TITANLITE_FAULT_SLOW_PURGE": str(delay)},
    ).ok()
    times = {r["step"]: r["step_time_s"] for r in result.metrics}
    # A deletion on the training thread makes step 5 last the whole delay; under a loaded machine's noise
    # (steps of 1-2.5 s on 2 shared cores) the step stays at least a second short of it.
    assert sorted(times) == [1, 2, 3, 4, 5] and times[5] < delay - 1, times
    assert "saved to" in result.log and "; deleting step-2 in the background" in result.log
    assert "step-4 kept until the deletion in progress ends" in result.log
    assert "checkpoint: waiting for the deletion of step-2.deleting, step-4.deleting" in result.log
    assert "checkpoint: old checkpoints deleted" in result.log
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-5"]


def test_a_stop_signal_exits_without_waiting_for_a_slow_deletion_and_the_next_run_deletes_it(tmp_path):
    """SIGUSR1 to the launcher (SLURM's warning before the end of a job) while each deletion of an old
    checkpoint takes 10 minutes, far past comm.stop_grace_seconds: the rank saves and exits, exit code 0,
    instead of waiting for the deletions until the launcher kills it (138, "without a new checkpoint")
    although the checkpoint was published. The pruned checkpoints are left retired, which no resume
    takes, and the next run resumes from the stop's checkpoint and deletes them."""
    dump, root = tmp_path / "run", tmp_path / "run" / "checkpoint"
    overrides = [*BASE, *SHALLOW, "--checkpoint.keep_latest_k", "1", "--comm.stop_grace_seconds", "20"]
    config = ["--config", "train_configs/debug_model.toml", "--job.dump_folder", str(dump)]
    proc = start_launch(
        [*config, *overrides, "--training.steps", "1000"], child_env(NGPU="1", TITANLITE_FAULT_SLOW_PURGE="600")
    )
    try:
        while not (dump / "metrics.jsonl").exists() or len((dump / "metrics.jsonl").read_text().splitlines()) < 3:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGUSR1)  # step 2 is saved and step-1's deletion is under way
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert launcher_lines(err) == [], err[-3000:]
    (step,), partial = folders.scan(root)
    retired = [p.name for p in folders.retired(root)]
    assert partial == [] and step >= 3 and retired == [f"step-{s}.deleting" for s in range(1, step)], retired
    assert f"stop signal (SIGUSR1) at step {step}: checkpoint saved to {root / f'step-{step}'}; exiting" in err
    left = ", ".join(retired)
    assert f"checkpoint: stop signal: {left} left retired, not deleted; the next run deletes them" in err
    assert err.count("left retired") == 1 and "waiting for the deletion" not in err
    assert_resumed(train(dump, 1, *overrides, "--training.steps", str(step + 1), launcher="run_train").ok(), step)
    assert sorted(p.name for p in root.iterdir()) == [f"step-{step + 1}"]


# --- a second run on the same dump folder -------------------------------------------------------------------


def test_a_locked_dump_folder_is_refused_in_one_line(tmp_path):
    dump = tmp_path / "run"
    held = DumpFolderLock(str(dump))  # this process plays the run that holds the folder
    try:
        holder = f"host {socket.gethostname()}, pid {os.getpid()}"
        proc = run(dump)
        assert proc.returncode == 2, proc.log[-3000:]
        (line,) = error_lines(proc)
        assert f"job.dump_folder {dump} is in use by another run ({holder}" in line, line
        assert not (dump / "metrics.jsonl").exists() and not (dump / "checkpoint").exists()
        pre = preflight("--job.dump_folder", str(dump), *BASE)
        assert pre.returncode == 2 and pre.stderr.count("\n") == 1 and holder in pre.stderr, pre.stderr
    finally:
        held.release()


# --- a bit flip in a shard, and a resume with changed settings ------------------------------------------


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> Path:
    """Steps 1-2 of the debug model with a checkpoint after each (and TensorBoard events)."""
    dump = tmp_path_factory.mktemp("two_checkpoints")
    run(dump, "--metrics.enable_tensorboard").ok()
    assert folders.scan(dump / "checkpoint") == ([1, 2], [])
    return dump


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src / "checkpoint", dst / "checkpoint")
    return dst


@pytest.fixture(scope="module")
def resumes(two_checkpoints, tmp_path_factory) -> dict[str, tuple[Path, RunResult]]:
    """Resumes of copies of `two_checkpoints`, two launches at a time: with step-2 bit-flipped (after the
    HF export refused it) and a new LR, with nothing to train, and with a new global batch."""
    root = tmp_path_factory.mktemp("resumes")

    def export_then_resume(dump: Path) -> RunResult:
        flip_a_bit(dump / "checkpoint" / "step-2" / "__0_0.distcp")
        export = subprocess.run(
            [sys.executable, "-m", "titanlite.tools.hf", "export", "--job.dump_folder", str(dump)]
            + ["--out", str(root / "hf"), "--training.seq_len", "64"],
            env=child_env(),
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        runs["export"] = (root / "hf", RunResult(export.returncode, export.stdout, export.stderr, dump))
        return run(dump, "--optimizer.lr", "1e-3", steps=3)

    runs: dict[str, tuple[Path, RunResult]] = {}
    launches = {
        "bit_flip": (export_then_resume, copy_of(two_checkpoints, root / "bit_flip")),
        "nothing_to_train": (
            lambda dump: run(dump, "--metrics.enable_tensorboard", "--metrics.peak_tflops", "1e-4", steps=2),
            Path(shutil.copytree(two_checkpoints, root / "nothing")),
        ),
        "new_global_batch": (
            lambda dump: run(dump, "--training.global_batch_size", "4", steps=3),
            copy_of(two_checkpoints, root / "batch"),
        ),
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: (dump, pool.submit(launch, dump)) for name, (launch, dump) in launches.items()}
        runs.update({name: (dump, future.result()) for name, (dump, future) in futures.items()})
    return runs


def test_a_bit_flip_is_refused_by_export_and_skipped_by_resume(resumes):
    hf, export = resumes["export"]
    assert export.returncode == 2 and export.stderr.count("\n") == 1, export.stderr[-3000:]
    assert "step-2 is unusable: file __0_0.distcp has CRC-32" in export.stderr and "(corrupted)" in export.stderr
    assert not hf.exists()
    _, proc = resumes["bit_flip"]
    assert proc.returncode == 0, proc.log[-3000:]
    warned = [line for line in proc.stderr.splitlines() if "WARNING" in line]
    assert len(warned) == 1 and "step-2 is unusable: file __0_0.distcp has CRC-32" in warned[0], warned
    assert "trying the previous one" in warned[0]
    assert "resumed from" in proc.stderr and "step-1 at step 1" in proc.stderr
    assert [r["step"] for r in proc.metrics] == [2, 3]


def test_a_new_lr_is_used_after_resume(resumes):
    """The bit-flip run above resumed step-1 of a 2-step run at LR 3e-3 with LR 1e-3 and 3 steps."""
    _, proc = resumes["bit_flip"]
    assert proc.returncode == 0, proc.log[-3000:]
    (changed,) = [line for line in proc.stderr.splitlines() if "settings changed since" in line]
    assert "optimizer.lr 0.003 -> 0.001" in changed and "training.steps 2 -> 3" in changed, changed
    # The LR after each resumed step is the new base LR on the new 3-step schedule (debug_model.toml's
    # warmup and decay).
    assert [r["step"] for r in proc.metrics] == [2, 3]
    for row in proc.metrics:
        factor = lr_factor(
            row["step"], total_steps=3, warmup_steps=10, decay_ratio=1.0, decay_type="cosine", min_lr_factor=0.1
        )
        assert row["lr"] == pytest.approx(1e-3 * factor, rel=1e-6), row


def test_a_resume_with_nothing_to_train_says_so_and_adds_no_run(resumes, two_checkpoints):
    """In the dump folder of the run it resumes: no TensorBoard run, no run number, no metrics row. At a
    peak of 1e-4 TFLOP/s a debug step takes a minute: the launcher says so before any rank starts."""
    dump, proc = resumes["nothing_to_train"]
    assert proc.returncode == 0, proc.log[-3000:]
    assert proc.stderr.startswith(
        "titanlite: warning: train_configs/debug_model.toml is sized for a GPU: on this CPU a step is 4.2e+09 "
        "FLOP per process, at least 0:00:42 at metrics.peak_tflops of 0.0001 TFLOP/s, 0:01:24 for 2 steps; "
        "training anyway (Ctrl-C stops)\n[rank0]: "
    ), proc.stderr
    assert "nothing to train: resumed at step 2, training.steps is 2 (raise training.steps to train on)" in proc.stderr
    assert "training finished" not in proc.stderr and "metrics:" not in proc.stderr
    # The warning, 7 rank lines (one of them the changed peak_tflops since the checkpoint) and the goodput line.
    assert len(proc.stderr.splitlines()) == 9 and proc.stdout == "", proc.stderr
    assert GOODPUT_LINE.fullmatch(proc.stderr.splitlines()[-1]), proc.stderr
    assert [p.name for p in (dump / "tb").iterdir()] == ["run001-1proc"]
    for name in ("metrics.jsonl", "runs.jsonl"):
        assert (dump / name).read_text() == (two_checkpoints / name).read_text()
    assert [json.loads(line)["run"] for line in (dump / "metrics.jsonl").read_text().splitlines()] == [1, 1]


def test_generate_names_the_checkpoint_it_loaded(two_checkpoints):
    """`python -m titanlite.tools.generate` on the run's folder: the newest checkpoint, named on stderr."""
    cmd = [sys.executable, "-m", "titanlite.tools.generate", "--job.dump_folder", str(two_checkpoints)]
    cmd += ["--training.seq_len", "64", "--prompt", "The", "--max_new_tokens", "4"]
    proc = subprocess.run(cmd, env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 2 and lines[0] == f"loaded {two_checkpoints / 'checkpoint' / 'step-2'}", lines
    assert lines[1].startswith("generated 4 tokens in ") and proc.stdout.startswith("The"), lines


def test_a_new_global_batch_stops_the_resume_in_one_line(resumes):
    dump, proc = resumes["new_global_batch"]
    assert proc.returncode == 2, proc.log[-3000:]
    (line,) = error_lines(proc)
    assert "training.global_batch_size was 2 samples per step, this run has 4 samples per step" in line, line
    assert folders.scan(dump / "checkpoint") == ([1, 2], [])
    assert json.loads((dump / "checkpoint" / "step-2" / folders.MARKER).read_text())["step"] == 2
