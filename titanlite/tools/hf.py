"""Export a training checkpoint to Hugging Face safetensors:

    python -m titanlite.tools.hf export --config FILE [--step N] --out DIR [--max-shard-mb M] [--section.key value ...]

The model is built as the trainer builds it (`titanlite.build`), in one process or under torchrun with
the training layout; the newest complete checkpoint (or `--step N`) of the run's dump folder is verified
(file sizes and checksums, each rank its share), loaded and written by `titanlite.checkpoint.hf.export_hf`
in `checkpoint.export_dtype`. A damaged checkpoint is refused in one line (exit code 2), never replaced
by an older one behind the user's back: `--step` names an intact one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

from titanlite.build import RunPlan, build_model, init_device, init_distributed, world_from_env
from titanlite.checkpoint import folders
from titanlite.checkpoint.hf import export_hf
from titanlite.checkpoint.manager import load_model_weights, verify_checksums
from titanlite.config import DEFAULT_CONFIG, DTYPES, load_config
from titanlite.errors import CheckpointError, run_cli

USAGE = "usage: python -m titanlite.tools.hf export --config FILE [--step N] --out DIR [--max-shard-mb M]"


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "export":
        print(USAGE, file=sys.stderr)
        return 2
    opts = {"--step": "-1", "--out": "", "--max-shard-mb": "2048"}
    rest, i = [], 1
    while i < len(argv):
        if argv[i] in opts and i + 1 < len(argv):
            opts[argv[i]] = argv[i + 1]
            i += 2
        else:
            rest.append(argv[i])
            i += 1
    if not opts["--out"]:
        raise CheckpointError(f"--out is required ({USAGE})")
    cfg = load_config(rest, default_config=DEFAULT_CONFIG)
    rank, world_size = world_from_env()
    plan = RunPlan.build(cfg, world_size)
    if plan.spec.hf_adapter is None:
        raise CheckpointError(f"model {cfg.model.name!r} has no Hugging Face adapter")
    device = init_device()
    init_distributed(cfg, device)
    try:
        model = build_model(plan, device)
        root = Path(cfg.job.dump_folder) / cfg.checkpoint.folder
        step = int(opts["--step"])
        path = folders.newest(root) if step < 0 else folders.step_dir(root, step)
        if path is None or not path.is_dir():
            raise CheckpointError(
                f"no complete checkpoint in {root}" if path is None else f"checkpoint {path} does not exist"
            )
        if why := folders.problem(path) or verify_checksums(str(path), folders.read_marker(path)):
            raise CheckpointError(f"checkpoint {path} is unusable: {why}; not exported")
        load_model_weights(model, str(path))
        export_hf(
            model,
            opts["--out"],
            adapter=plan.spec.hf_adapter,
            dtype=DTYPES[cfg.checkpoint.export_dtype],
            bos_id=plan.tokenizer.bos_id,
            eos_id=plan.tokenizer.eos_id,
            max_shard_bytes=int(float(opts["--max-shard-mb"]) * 2**20),
        )
        if rank == 0:
            print(f"exported {path} to {opts['--out']}", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
