"""Replica groups (fault_tolerance.enable) as users start them, for the tests that run them: a lighthouse from
`titanlite.tools.lighthouse` in the foreground, and each group its own `run_train.sh` of one rank with its
own dump folder, on CPU with gloo; and what the tests read of a group's run."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from harness import ROOT, RunResult, child_env, start_launch

FT = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2", "--metrics.log_freq", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@dataclass
class Lighthouse:
    proc: subprocess.Popen
    address: str
    log: Path

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)


def start_lighthouse(tmp: Path, min_replicas: int = 1) -> Lighthouse:
    """`python -m titanlite.tools.lighthouse` in the foreground, as the docs start it; returns once it serves."""
    port, log = free_port(), tmp / "lighthouse.log"
    cmd = [sys.executable, "-m", "titanlite.tools.lighthouse", "--min_replicas", str(min_replicas), "--port", str(port)]
    cmd += ["--heartbeat_timeout_ms", "2000", "--join_timeout_ms", "500"]
    proc = subprocess.Popen(cmd, env=child_env(), cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while "serving on" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    return Lighthouse(proc, f"http://localhost:{port}", log)


def start_group(tmp: Path, lighthouse: str, replica: int, *overrides: str) -> tuple[subprocess.Popen, Path]:
    """Replica group `replica`: `run_train.sh` of one rank into its own dump folder, joining the lighthouse
    at address `lighthouse`."""
    dump = tmp / f"group{replica}"
    args = [*FT, "--fault_tolerance.replica_id", str(replica), "--job.dump_folder", str(dump), *overrides]
    env = child_env(NGPU="1", TORCHFT_LIGHTHOUSE=lighthouse, OMP_NUM_THREADS="1")
    return start_launch(args, env), dump


def finish(proc: subprocess.Popen, dump: Path, timeout: float = 600) -> RunResult:
    out, err = proc.communicate(timeout=timeout)
    return RunResult(proc.returncode, out, err, dump)


def rows(result: RunResult) -> list[dict]:
    return [r for r in result.metrics if "loss" in r]


def wait_for_step(dump: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not any(r.get("step", 0) >= step for r in RunResult(0, "", "", dump).metrics):
        assert proc.poll() is None and time.monotonic() < deadline, f"group stopped before step {step}"
        time.sleep(0.2)
