"""run_train.sh and its launcher (titanlite/launch.py) as a scheduler and a terminal use them.

Each case starts `run_train.sh` in a session of its own (as a job is), waits for the first logged step,
signals the launcher or its whole process group the way SLURM, Kubernetes or a terminal do, and checks
the exit code, what the user sees on stderr besides the ranks' own log (`[rankN]:` lines), the
checkpoint folder, and that no rank process outlives the run. Failures inside ranks come from the
test-only `TITANLITE_FAULT_*` variables (titanlite/resilience.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from harness import ROOT, SMALL, child_env
from titanlite.agent import root_cause
from titanlite.resilience import write_failure

# Long enough to be running when signalled; checkpoints only when stopped.
RUN = [*SMALL, "--training.steps", "1000", "--checkpoint.enable", "--checkpoint.interval", "1000"]


@dataclass
class Case:
    name: str
    signals: list[tuple[str, signal.Signals]] = field(default_factory=list)  # ("group" | "launcher", signal)
    env: dict[str, str] = field(default_factory=dict)
    code: int = 0
    lines: list[str] = field(default_factory=list)  # the launcher's own stderr lines (prefixes)
    saved: bool = False  # a complete checkpoint of the step the ranks stopped at
    traceback: bool = False
    nproc: int = 2  # one rank where a second adds nothing to what the case checks


CASES = [
    Case("sigterm-to-group", [("group", signal.SIGTERM)], saved=True),
    Case("sigterm-to-launcher", [("launcher", signal.SIGTERM)], saved=True),
    Case("sigusr1-to-launcher", [("launcher", signal.SIGUSR1)], saved=True, nproc=1),
    Case("ctrl-c", [("group", signal.SIGINT)], saved=True, nproc=1),
    Case(
        "ctrl-c-twice",
        [("group", signal.SIGINT), ("group", signal.SIGINT)],
        code=130,
        lines=["titanlite: interrupted twice: ranks killed without a new checkpoint"],
        nproc=1,
    ),
    Case("sigkill-of-launcher", [("launcher", signal.SIGKILL)], code=-signal.SIGKILL, nproc=1),
    Case(
        "user-error-in-rank-1",
        env={"TITANLITE_FAULT_USER_ERROR_AT": "2", "TITANLITE_FAULT_RANK": "1"},
        code=2,
        lines=["titanlite: error: fault injection: rank 1 found bad input at step 2"],
    ),
    Case(
        "non-finite-loss",
        env={"TITANLITE_FAULT_NAN_AT": "2"},
        code=3,
        lines=["titanlite: error: non-finite step 2: loss nan"],
        nproc=1,
    ),
    Case(
        "crash-in-rank-1",
        env={"TITANLITE_FAULT_CRASH_AT": "2", "TITANLITE_FAULT_RANK": "1"},
        code=1,
        lines=["titanlite: error: rank 1 crashed:", "Traceback (most recent call last):"],
        traceback=True,
    ),
]


def rank_processes(marker: str) -> list[int]:
    """Pids of live processes whose command line contains `marker` (the case's own dump folder)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state != "Z":
            pids.append(int(entry.name))
    return pids


def wait_for_first_step(proc: subprocess.Popen, dump: Path, timeout: float = 180) -> None:
    metrics = dump / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and metrics.read_text().strip()):
        assert proc.poll() is None, f"exited with {proc.returncode} before the first step"
        assert time.monotonic() < deadline, "no step logged"
        time.sleep(0.1)


@dataclass
class Outcome:
    returncode: int
    stderr: str
    dump: Path
    survivors: list[int]  # rank processes still alive 10 s after the launcher ended


def launch(case: Case, dump: Path) -> Outcome:
    proc = subprocess.Popen(
        [str(ROOT / "run_train.sh"), "--job.dump_folder", str(dump), *RUN],
        env=child_env(NGPU=str(case.nproc), **case.env),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a job has
    )
    try:
        if case.signals:
            wait_for_first_step(proc, dump)
        for target, sig in case.signals:
            os.killpg(proc.pid, sig) if target == "group" else os.kill(proc.pid, sig)
            time.sleep(0.1)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + 10
    while rank_processes(str(dump)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return Outcome(proc.returncode, err, dump, rank_processes(str(dump)))


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, Outcome]:
    """Every case, two launches at a time: one launch keeps about one of the two cores busy."""
    root = tmp_path_factory.mktemp("launcher")
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {c.name: pool.submit(launch, c, root / c.name) for c in CASES}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_launcher_signals_and_errors(outcomes, case):
    run = outcomes[case.name]
    err = run.stderr
    assert run.returncode == case.code, err[-4000:]
    assert run.survivors == []  # no rank outlives its launcher, however it ended

    own = [line for line in err.splitlines() if not line.startswith("[rank")]
    if case.traceback:
        assert own[: len(case.lines)] == case.lines and err.count("Traceback") == 1, err[-4000:]
        assert own[-1] == "RuntimeError: fault injection: rank 1 crashed at step 2"
    else:
        assert len(own) == len(case.lines), err[-4000:]
        assert all(line.startswith(prefix) for line, prefix in zip(own, case.lines)), own
        assert "Traceback" not in err

    done = sorted(p.name for p in (run.dump / "checkpoint").glob("step-*") if not p.name.endswith(".partial"))
    if case.saved:
        stopped = [line for line in err.splitlines() if "stop signal" in line]
        step = max(json.loads(line)["step"] for line in (run.dump / "metrics.jsonl").open())
        assert len(stopped) == 1 and f"stop signal ({case.signals[0][1].name}) at step {step}:" in stopped[0]
        assert done == [f"step-{step}"]
    else:
        assert done == []


@pytest.mark.slow
@pytest.mark.parametrize("var,value", [("NGPU", "0"), ("NGPU", "abc"), ("NNODES", "0")])
def test_bad_environment_is_one_line_before_anything_starts(tmp_path, var, value):
    proc = subprocess.run(
        [str(ROOT / "run_train.sh"), "--job.dump_folder", str(tmp_path / "dump")],
        env=child_env(**{var: value}),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"titanlite: error: {var} must be a positive integer") and f"'{value}'" in lines[0]
    assert not (tmp_path / "dump").exists()


def failure(tmp_path: Path, rank: int, exitcode: int, report: tuple[str, int, float] | None = None) -> ProcessFailure:
    """A failed rank as torch's agent sees it; `report` = (message, exit code, time) written as a rank does."""
    path = tmp_path / f"error-{rank}-{time.monotonic_ns()}.json"  # a fresh file for every failure
    if report is not None:
        error = RuntimeError()
        error._titanlite_failed_at = report[2]
        write_failure(str(path), report[0], report[1], error)
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))


def test_root_cause_is_the_user_error_then_an_abrupt_death_then_the_first_traceback(tmp_path):
    gloo = "Traceback (most recent call last):\nRuntimeError: Connection closed by peer"
    user = "titanlite: error: checkpoint step-9 is unusable"
    # A user error wins over a peer's earlier traceback; its exit code is the one the rank meant, even
    # if the rank was stopped by SIGTERM while exiting.
    got = root_cause({0: failure(tmp_path, 0, 1, (gloo, 1, 5.0)), 1: failure(tmp_path, 1, -15, (user, 2, 6.0))}, "L")
    assert (got.text, got.code) == (user, 2)
    # A rank that died without a report (killed, os._exit) is the cause of its peers' tracebacks.
    got = root_cause({0: failure(tmp_path, 0, 1, (gloo, 1, 5.0)), 1: failure(tmp_path, 1, -9)}, "/tmp/logs")
    assert (got.text, got.code) == (
        "titanlite: error: rank 1 was killed by SIGKILL (the ranks' logs are in /tmp/logs)",
        1,
    )
    # Among tracebacks, the earliest.
    boom = "Traceback (most recent call last):\nValueError: boom"
    got = root_cause({0: failure(tmp_path, 0, 1, (gloo, 1, 7.0)), 1: failure(tmp_path, 1, 1, (boom, 1, 6.0))}, "L")
    assert (got.text, got.code) == (f"titanlite: error: rank 1 crashed:\n{boom}", 1)
