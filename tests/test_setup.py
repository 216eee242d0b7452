"""The environment set-up (scripts/env.sh): refused inside a SLURM job, where every node would install
into the shared checkout at once; `bash scripts/env.sh` on a login node is the one-time step."""

from __future__ import annotations

import shutil
import subprocess

from harness import ROOT, child_env


def test_setup_inside_a_slurm_job_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "env.sh", tmp_path / "scripts" / "env.sh")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    env = child_env(SLURM_JOB_ID="1234")
    for key in ("PYTHON", "VIRTUAL_ENV", "CONDA_PREFIX"):
        env.pop(key, None)
    proc = subprocess.run(["bash", "scripts/env.sh"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "bash scripts/env.sh' once on a login node" in proc.stderr
    assert not (tmp_path / ".venv").exists()
