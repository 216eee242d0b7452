"""Sample text from a trained model, in one process.

usage: python -m titanlite.generate [--config FILE] [--checkpoint DIR | --step N | --hf DIR] --prompt TEXT
                                    [--max_new_tokens N] [--temperature T] [--top_k K] [--seed S]
                                    [--section.key value ...]

  --config FILE        the run's config (default train_configs/debug_model.toml) and --section.key
                       overrides, as in training: they give the model, the tokenizer and the run's folder
  --checkpoint DIR     the weights of this checkpoint folder (`.../checkpoint/step-N`)
  --step N             step N of the run's checkpoints (default: the newest complete one)
  --hf DIR             the weights of a Hugging Face folder instead (its config.json must match the flavor)
  --prompt TEXT        the text to continue (BOS is prepended, as in training)
  --max_new_tokens N   tokens to generate at most (default 50); generation also stops at EOS
  --temperature T      0 = greedy (the default: the same tokens as transformers' generate()); > 0 samples
  --top_k K            sample only among the K most likely tokens (0 = all)
  --seed S             the sampling seed (default 0): the same seed gives the same text
  -h, --help           this text

Prints the prompt and its continuation on stdout, and the speed on stderr. Each new token runs the model
over the whole sequence so far (no KV cache): the model's own forward, unchanged, is what generates, and
at the lengths a trained debug model supports the recomputation is cheap (README: tokens/s measured).
Runs on the first CUDA device if there is one, else on the CPU, in float32.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from titanlite.build import RunPlan, init_device, init_distributed
from titanlite.checkpoint.hf import import_hf
from titanlite.checkpoint.manager import load_tool_weights
from titanlite.config import DEFAULT_CONFIG, load_config
from titanlite.errors import CheckpointError, ConfigError, run_cli
from titanlite.sampling import next_token
from titanlite.tools.options import number, split_options

OPTIONS = {
    "--checkpoint": "",
    "--step": "-1",
    "--hf": "",
    "--prompt": "",
    "--max_new_tokens": "50",
    "--temperature": "0",
    "--top_k": "0",
    "--seed": "0",
}


@torch.no_grad()
def generate(
    model: nn.Module,
    ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The new token ids after `ids` (at most `max_new_tokens`, ending at `eos_id` if it comes)."""
    device = next(model.parameters()).device
    tokens = torch.tensor([ids], device=device)
    new: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(tokens)[0, -1].float()
        token = next_token(logits, temperature, top_k, generator)
        new.append(token)
        if token == eos_id:
            break
        tokens = torch.cat([tokens, torch.tensor([[token]], device=device)], dim=1)
    return new


def load_model(plan: RunPlan, device: torch.device, seq_len: int, *, checkpoint: str, step: int, hf: str) -> nn.Module:
    """The plain (unparallelized) model with RoPE tables for `seq_len` positions, weights from `hf` (an HF
    folder) or a checkpoint of the run (`load_tool_weights`)."""
    with device:
        model = plan.spec.model_cls(plan.model_args, seq_len=seq_len)
    if hf:
        if plan.spec.hf_adapter is None:
            raise CheckpointError(f"model {plan.cfg.model.name!r} has no Hugging Face adapter")
        import_hf(model, hf, adapter=plan.spec.hf_adapter, what=f"model.flavor {plan.cfg.model.flavor!r}")
    else:
        load_tool_weights(model, plan.cfg, checkpoint, step)
    return model.eval()


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    opts, rest = split_options(argv, OPTIONS)
    if not opts["--prompt"]:
        raise ConfigError("--prompt is required (python -m titanlite.generate --help)")
    if opts["--hf"] and (opts["--checkpoint"] or opts["--step"] != "-1"):
        raise ConfigError("--hf excludes --checkpoint and --step")
    max_new, top_k, seed = (int(number(opts, k)) for k in ("--max_new_tokens", "--top_k", "--seed"))
    temperature = float(number(opts, "--temperature", float))
    if max_new < 1 or top_k < 0 or temperature < 0:
        raise ConfigError("--max_new_tokens must be positive, --top_k and --temperature non-negative")
    cfg = load_config(rest, default_config=DEFAULT_CONFIG)
    plan = RunPlan.build(cfg, 1)
    ids = plan.tokenizer.encode(opts["--prompt"], bos=True, eos=False)
    limit = plan.model_args.max_seq_len
    if len(ids) + max_new > limit:
        raise ConfigError(
            f"the prompt ({len(ids)} tokens) plus --max_new_tokens {max_new} exceed the model's max_seq_len {limit}"
        )
    device = init_device()
    init_distributed(cfg, device)  # a one-rank group: DCP reads checkpoints through it
    try:
        model = load_model(
            plan, device, len(ids) + max_new, checkpoint=opts["--checkpoint"], step=int(opts["--step"]), hf=opts["--hf"]
        )
        generator = torch.Generator(device=device).manual_seed(seed)
        start = time.perf_counter()
        new = generate(
            model, ids, max_new, temperature=temperature, top_k=top_k, eos_id=plan.tokenizer.eos_id, generator=generator
        )
        seconds = time.perf_counter() - start
    finally:
        dist.destroy_process_group()
    text = plan.tokenizer.decode([i for i in new if i != plan.tokenizer.eos_id])
    print(opts["--prompt"] + text, flush=True)
    print(f"generated {len(new)} tokens in {seconds:.2f} s ({len(new) / seconds:.1f} tokens/s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
