"""Export a training checkpoint as a Hugging Face model folder that `transformers` loads whole.

usage: python -m titanlite.tools.hf export [--config FILE] --out DIR [--checkpoint DIR | --step N]
                                           [--max-shard-mb M] [--section.key value ...]

  --config FILE       the run's config (default train_configs/debug_model.toml), with the same
                      --section.key overrides as training: they locate the run (job.dump_folder,
                      checkpoint.folder) and give the model and tokenizer
  --out DIR           the folder to create (must not exist)
  --checkpoint DIR    export this checkpoint folder (a `step-N` folder of any run of this model)
  --step N            export step N of the run (default: its newest complete checkpoint)
  --max-shard-mb M    largest safetensors file (default 2048)
  -h, --help          this text

The folder holds `model-0000K-of-0000N.safetensors` + index, `config.json`, `generation_config.json`
(greedy, stops at EOS) and the tokenizer (`tokenizer.json`, `tokenizer_config.json`: training's ids in
`transformers`, BOS prepended where training prepends it, no chat template) of `model.tokenizer_path` or
the bundled vocabulary; the tokenizer needs the `hf` extra (`pip install -e '.[hf]'`), without it the
weights are exported and a warning says so. Weights are written in `checkpoint.export_dtype`. Run it
through the project's Python, e.g.

    scripts/python.sh -m titanlite.tools.hf export --config train_configs/debug_model.toml --out hf_out

The model is built as the trainer builds it (`titanlite.run.build`), in one process or under torchrun with
the training layout; the checkpoint is verified (file sizes and checksums, each rank its share) and a
damaged one is refused in one line (exit code 2), never replaced by an older one behind the user's back.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

from titanlite import torch_support
from titanlite.checkpoint.hf import export_hf
from titanlite.checkpoint.weights import load_tool_weights
from titanlite.config import DEFAULT_CONFIG, load_config
from titanlite.errors import CheckpointError, ConfigError, UserError, exit_now, run_tool
from titanlite.planning.run_plan import RunPlan
from titanlite.run.build import build_model, init_device, init_distributed, world_from_env
from titanlite.tools.options import number, split_options

USAGE = (
    "usage: python -m titanlite.tools.hf export [--config FILE] --out DIR [--checkpoint DIR | --step N] "
    "[--max-shard-mb M] [--section.key value ...]"
)


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    if not argv or argv[0] != "export":
        print(USAGE, file=sys.stderr)
        return 2
    opts, rest = split_options(argv[1:], {"--step": "-1", "--out": "", "--checkpoint": "", "--max-shard-mb": "2048"})
    if not opts["--out"]:
        raise ConfigError(f"--out is required ({USAGE})")
    if opts["--checkpoint"] and opts["--step"] != "-1":
        raise ConfigError("--checkpoint and --step exclude each other")
    step = number(opts, "--step")
    shard_bytes = int(number(opts, "--max-shard-mb", float) * 2**20)
    if shard_bytes <= 0:
        raise ConfigError(f"--max-shard-mb {opts['--max-shard-mb']} must be positive")
    cfg = load_config(rest, default_config=DEFAULT_CONFIG)
    rank, world_size = world_from_env()
    plan = RunPlan.build(cfg, world_size)
    adapter = plan.spec.require_hf_adapter()
    if Path(opts["--out"]).exists():
        raise CheckpointError(f"export folder {opts['--out']} already exists")
    tokenizer_files: dict[str, str] = {}
    if rank == 0:
        from titanlite.data.hf_tokenizer import hf_tokenizer_files

        try:
            tokenizer_files = hf_tokenizer_files(plan.tokenizer, plan.model_args.max_seq_len)
        except UserError as e:
            print(f"titanlite: warning: tokenizer not exported: {e}", file=sys.stderr, flush=True)
    device = init_device()
    init_distributed(cfg, device)
    try:
        model = build_model(plan, device)
        path = load_tool_weights(model, cfg, opts["--checkpoint"], step)
        export_hf(
            model,
            opts["--out"],
            adapter=adapter,
            dtype=torch_support.dtype(cfg.checkpoint.export_dtype),
            bos_id=plan.tokenizer.bos_id,
            eos_id=plan.tokenizer.eos_id,
            max_shard_bytes=shard_bytes,
            write_extra=lambda folder: [(folder / name).write_text(text) for name, text in tokenizer_files.items()],
        )
        if rank == 0:
            print(f"exported {path} to {opts['--out']}", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_now(run_tool(main))
