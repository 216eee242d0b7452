"""Shared test helpers: launching torchrun workers on CPU/gloo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def torchrun(args: list[str], nproc: int, timeout: float = 600, env: dict | None = None,
             cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run `python -m torch.distributed.run --standalone --nproc_per_node N <args>`; output captured."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    return subprocess.run(cmd, env=env or child_env(), cwd=cwd or ROOT, capture_output=True, text=True,
                          timeout=timeout)


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-6000:]
        pytest.fail(f"exit code {proc.returncode}\n{tail}")
