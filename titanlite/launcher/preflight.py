"""Check a run before torchrun starts any rank: `python -m titanlite.launcher.preflight --config FILE [overrides]`.

Validates the config with every rule between its keys (the run plan, `titanlite/planning/run_plan.py`), the mesh for
WORLD_SIZE, the model's shape, the network interfaces named for NCCL and gloo (`socket_interfaces.py`),
optional packages it needs (wandb), the tokenizer file, the training and validation data, the checkpoint
to load, and that the dump, checkpoint and node-local checkpoint folders are writable, in one process, so
bad input is one line and exit code 2 instead of one traceback per rank. On success prints the torchrun
restart budget (`comm.max_restarts`) for run_train.sh.

One warning, not a refusal: a run on a machine without CUDA whose step costs more than
`CPU_STEP_WARNING_S` at the CPU's peak (a config sized for a GPU) says so, with the cost, and goes on.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path

from titanlite.checkpoint import folders, lock, node_local
from titanlite.checkpoint.hf import check_hf_config, configured_model, hf_without_flag, is_hf_folder
from titanlite.config import DEFAULT_CONFIG, Checkpoint, JobConfig, load_config
from titanlite.data.data_source import DataSource
from titanlite.errors import CheckpointError, ConfigError, run_cli
from titanlite.metrics import check_wandb
from titanlite.parallelisms.parallelize import check_device
from titanlite.planning.run_plan import RunPlan
from titanlite.run.loader import build_loader, build_validation_loader
from titanlite.run.socket_interfaces import check as check_socket_interfaces

logger = logging.getLogger("titanlite")


def check_writable(key: str, path: str | Path) -> None:
    """The folder `key` names exists (it is created) and takes a new file: a read-only mount, a full
    disk's inodes or missing permissions are one line here instead of a traceback in a rank."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{key} {str(path)!r} is a file, not a folder")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ConfigError(f"{key} {str(path)!r} is not writable: {e.strerror}") from None


def check_checkpoint(cfg: Checkpoint, dump_folder: str) -> None:
    """The checkpoint a run would load exists: `load_step`'s folder is complete and intact, and
    `initial_load_path` (read only when there is no checkpoint to resume from) is a folder.

    Read-only: the ranks' own choice (`folders.choose`) also removes interrupted saves.
    """
    if cfg.create_seed_checkpoint:
        return  # writes step 0 and loads nothing
    root = Path(dump_folder) / cfg.folder
    done = folders.scan(root)[0] if cfg.enable else []
    if cfg.enable and cfg.load_step >= 0:
        path = folders.step_dir(root, cfg.load_step)
        if cfg.load_step not in done:
            have = ", ".join(f"step-{s}" for s in done) or "none"
            raise CheckpointError(
                f"checkpoint.load_step {cfg.load_step}: {path} does not exist (complete checkpoints: {have})"
            )
        if why := folders.problem(path):
            raise CheckpointError(f"checkpoint {path} is unusable: {why}")
    if cfg.initial_load_path and not done:  # read only when there is no checkpoint to resume from
        if not Path(cfg.initial_load_path).is_dir():
            raise CheckpointError(f"checkpoint.initial_load_path {cfg.initial_load_path} is not a folder")
        if not cfg.initial_load_in_hf and is_hf_folder(cfg.initial_load_path):
            raise CheckpointError(hf_without_flag(cfg.initial_load_path))
    if cfg.enable:  # every run that checkpoints saves at its end
        check_writable("checkpoint.folder", root)
    if cfg.enable and cfg.local_interval:  # on this node: each node's launcher runs the preflight
        check_writable("checkpoint.local_folder", node_local.folder_of(cfg, dump_folder))


def check_initial_hf(plan: RunPlan) -> None:
    """A Hugging Face `initial_load_path` that would be loaded (no checkpoint to resume from) has a
    `config.json` matching the configured model: a mismatch is one line here, before any rank starts."""
    cfg = plan.cfg.checkpoint
    if not (cfg.initial_load_in_hf and cfg.initial_load_path) or cfg.create_seed_checkpoint:
        return
    if cfg.enable and folders.scan(Path(plan.cfg.job.dump_folder) / cfg.folder)[0]:
        return
    adapter = plan.spec.require_hf_adapter()
    check_hf_config(cfg.initial_load_path, plan.model_args, adapter, configured_model(plan.cfg, plan.spec.shape.keys))


CPU_STEP_WARNING_S = 10.0
"""A step whose FLOPs alone take longer than this at the CPU's peak is announced before any rank starts:
otherwise a config sized for a GPU (the 1B one: 5.5e13 FLOP per step, about 10 minutes on a 2-core
machine) shows nothing for minutes while it builds, compiles and runs its first step."""


def cpu_step_warning(plan: RunPlan) -> str | None:
    """Where the ranks will train on CPU (no CUDA here) and a step's FLOPs per process (the MFU's: 6N plus
    attention per token, the plan's tokens per process) take over `CPU_STEP_WARNING_S` at the peak MFU is
    measured against (`metrics.peak_tflops`, else this CPU's measured fp32 peak), the line that says so;
    None otherwise."""
    import torch

    from titanlite.metrics import clock
    from titanlite.metrics.mfu import Peak

    if torch.cuda.is_available() or plan.cfg.checkpoint.create_seed_checkpoint:
        return None
    cfg = plan.cfg
    flops = plan.model_args.flops_per_token(cfg.training.seq_len) * plan.tokens_per_gpu_step
    peak = Peak(cfg.metrics.peak_tflops, torch.device("cpu"))
    assert peak.tflops is not None  # a CPU's is always known
    seconds = flops / (peak.tflops * 1e12)
    if seconds <= CPU_STEP_WARNING_S:
        return None
    which = "metrics.peak_tflops" if cfg.metrics.peak_tflops else "this CPU's measured fp32 peak"
    name = cfg.job.config_file or "this config"
    compiled = " plus compilation" if cfg.compile.enable else ""
    steps = cfg.training.steps
    return (
        f"{name} is sized for a GPU: on this CPU a step is {flops:.2g} FLOP per process, at least "
        f"{clock(seconds)} at {which} of {peak.tflops:.3g} TFLOP/s, {clock(seconds * steps)} for {steps} "
        f"steps{compiled}; training anyway (Ctrl-C stops)"
    )


def check_data(plan: RunPlan) -> None:
    """The training and validation data, once per node for its ranks: local files indexed (`data/index.py`),
    pre-tokenized shards verified against their digests and recorded (`data/verified_shards.py`), bad data
    reported; hf:// streams are the ranks'."""
    cfg = plan.cfg
    if plan.data.local:
        build_loader(plan, dp_rank=0, verify=True)
    if cfg.validation.enable and DataSource.parse(cfg.validation.dataset_path or cfg.training.dataset_path).local:
        build_validation_loader(plan, dp_rank=0, verify=True)


def check_run(cfg: JobConfig, world_size: int) -> RunPlan:
    """Every check of the module docstring on a loaded config; returns the run plan they built."""
    plan = RunPlan.build(cfg, world_size)
    check_socket_interfaces(os.environ)
    check_wandb(cfg.metrics)
    if not cfg.checkpoint.create_seed_checkpoint:  # a seed checkpoint is built on the host, never on a GPU
        import torch

        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        check_device(cfg, plan.dims, device)
    check_writable("job.dump_folder", cfg.job.dump_folder)
    ckpt = cfg.checkpoint
    for key, folder in lock.run_folders(cfg.job.dump_folder, ckpt.folder if ckpt.enable else None).items():
        lock.check_free(folder, key)
    check_data(plan)
    check_checkpoint(cfg.checkpoint, cfg.job.dump_folder)
    check_initial_hf(plan)
    if warning := cpu_step_warning(plan):
        logger.warning(warning)
    return plan


def preflight(argv: list[str], world_size: int) -> int:
    """The checks on a command line; returns the torchrun restart budget."""
    return check_run(load_config(argv, default_config=DEFAULT_CONFIG), world_size).cfg.comm.max_restarts


def main(argv: list[str]) -> int:
    handler = logging.StreamHandler()  # warnings as the launcher prints them
    handler.setFormatter(logging.Formatter("titanlite: warning: %(message)s"))
    handler.setLevel(logging.WARNING)
    logger.addHandler(handler)
    print(preflight(argv, int(os.environ.get("WORLD_SIZE", "1"))))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
