"""How many processes a launch starts on this node, and the refusal to train on CPU where GPUs are.

`python -m titanlite.tools.visible_gpus [--ngpu N]` prints the number of ranks for this node: N where
given (the user's NGPU), else the CUDA GPUs torch sees, else 2 CPU processes. `run_train.sh` runs it
before anything starts.

GPUs are counted with `torch.cuda.device_count()`, which honours `CUDA_VISIBLE_DEVICES` and MIG without
initialising CUDA (`nvidia-smi -L` does neither). A node with GPUs that torch cannot use (a CPU build, or a
driver older than its CUDA) is refused in one line, exit code 2, rather than silently training on CPU;
`TITANLITE_DEVICE=cpu` says CPU on purpose. The CUDA build is read from torch/version.py without importing
torch, so the check costs nothing. The rules: docs/gpu.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

from titanlite.errors import UserError, run_cli

CPU_PROCESSES = 2
"""Ranks started where there is no GPU (or CPU on purpose) and NGPU is unset."""
CPU_SWITCH = "TITANLITE_DEVICE=cpu"


def torch_build() -> tuple[str, str | None]:
    """(torch's version, its CUDA or ROCm version or None for a CPU build), from torch/version.py unless torch
    is imported already."""
    if (torch := sys.modules.get("torch")) is not None:
        return torch.__version__, torch.version.cuda or torch.version.hip
    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.submodule_search_locations, "run_train.sh runs this with a Python that has torch"
    v = runpy.run_path(str(Path(list(spec.submodule_search_locations)[0]) / "version.py"))
    return v.get("__version__", "unknown"), v.get("cuda") or v.get("hip")


def slurm_gpus() -> int:
    """GPUs SLURM allocated to this node's part of the job (0 outside a job or without GPUs)."""
    count = os.environ.get("SLURM_GPUS_ON_NODE", "").strip()
    if count.isdigit():
        return int(count)
    ids = os.environ.get("SLURM_STEP_GPUS") or os.environ.get("SLURM_JOB_GPUS") or ""
    return len([i for i in ids.split(",") if i.strip()])


def listed_gpus() -> int:
    """GPUs that `nvidia-smi -L` lists (0 without nvidia-smi or where it fails)."""
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines()) if out.returncode == 0 else 0


def node_gpus() -> tuple[int, str]:
    """GPUs this node has, and who says so."""
    if n := listed_gpus():
        return n, "nvidia-smi lists"
    if n := slurm_gpus():
        return n, "SLURM allocated"
    return 0, ""


def visible_gpus() -> int:
    """CUDA devices a process started with this environment can use; 0 where CUDA is unusable. A CPU
    build of torch sees none: it is not imported (seconds) to be asked."""
    if torch_build()[1] is None:
        return 0
    import torch  # seconds: only when the count is needed

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def ranks_per_node(ngpu: str | None, cpu_on_purpose: bool) -> str:
    """The processes to start here (`ngpu` as given, checked by run_train.sh), or a UserError where the node's
    GPUs would go unused."""
    if cpu_on_purpose:
        return ngpu or str(CPU_PROCESSES)
    version, accel = torch_build()
    gpus, source = node_gpus()
    if gpus and accel is None:
        raise UserError(
            f"{source} {gpus} GPU(s) but torch {version} is a CPU build: every rank would train on CPU. Install "
            f"a CUDA build of torch (titanlite's .venv: `TITANLITE_TORCH=cuda bash scripts/env.sh`), or set "
            f"{CPU_SWITCH} to train on CPU on purpose"
        )
    if ngpu:
        return ngpu
    if visible := visible_gpus():
        return str(visible)
    if gpus:
        raise UserError(
            f"{source} {gpus} GPU(s) but torch {version} (CUDA {accel}) sees none (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}; a driver older than this CUDA?): set "
            f"{CPU_SWITCH} to train on CPU on purpose"
        )
    return str(CPU_PROCESSES)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m titanlite.tools.visible_gpus", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--ngpu", help="processes per node given by the user (NGPU); printed back once checked")
    parser.add_argument("--no-check", action="store_true", help="count only (a dry run plans on any machine)")
    args = parser.parse_args(argv)
    device = os.environ.get("TITANLITE_DEVICE", "")
    if device not in ("", "auto", "cpu"):
        raise UserError(f"TITANLITE_DEVICE must be cpu or auto, got '{device}'")
    if args.no_check:
        print(args.ngpu or visible_gpus() or CPU_PROCESSES)
    else:
        print(ranks_per_node(args.ngpu, device == "cpu"))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
