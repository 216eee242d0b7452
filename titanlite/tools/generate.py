"""Sample text from a trained model, in one process.

usage: python -m titanlite.tools.generate [--config FILE] [--checkpoint DIR | --step N | --hf DIR] --prompt TEXT
                                    [--max_new_tokens N] [--temperature T] [--top_k K] [--seed S]
                                    [--threads N] [--section.key value ...]

  --config FILE        the run's config (default train_configs/debug_model.toml) and --section.key
                       overrides, as in training: they give the model, the tokenizer and the run's folder
  --checkpoint DIR     the weights of this checkpoint folder (`.../checkpoint/step-N`)
  --step N             step N of the run's checkpoints (default: the newest complete one)
  --hf DIR             the weights of a Hugging Face folder instead (its config.json must match the flavor)
  --prompt TEXT        the text to continue (BOS is prepended, as in training)
  --max_new_tokens N   tokens to generate at most (default 50); generation also stops at EOS
  --temperature T      0 = greedy (the default: the same tokens as transformers' generate()); > 0 samples
  --top_k K            sample only among the K most likely tokens (0 = all; with --temperature > 0)
  --seed S             the sampling seed (default 0): the same seed gives the same text (with --temperature > 0)
  --threads N          CPU threads (default: OMP_NUM_THREADS if set, else the cores not busy: the core count
                       minus the 1-minute load average, at least 1)
  -h, --help           this text

Prints the prompt and its continuation on stdout; on stderr, the weights it loaded (`loaded
<dump_folder>/checkpoint/step-N`, or the Hugging Face folder) and the speed. The prompt runs through the
model once, then each new token alone against a KV cache of the keys and values so far (the model's
`new_cache`; the same tokens as recomputing the whole sequence, tests/unit/tools/test_generate.py). Runs on the first
CUDA device if there is one, else on the CPU, in float32. On CPU, one token at a time is a chain of small
matmuls: threads on cores that other work occupies wait for each other at every one of them (on a busy
2-core machine the debug model made 20 tokens/s with 2 threads, 314 with 1), hence the default.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from titanlite.checkpoint.hf import import_hf
from titanlite.checkpoint.weights import load_tool_weights
from titanlite.config import DEFAULT_CONFIG, load_config
from titanlite.errors import ConfigError, exit_now, run_tool
from titanlite.planning.run_plan import RunPlan
from titanlite.run.build import init_device, init_distributed
from titanlite.tools.options import number, split_options
from titanlite.tools.sampling import next_token

OPTIONS = {
    "--checkpoint": "",
    "--step": "-1",
    "--hf": "",
    "--prompt": "",
    "--max_new_tokens": "50",
    "--temperature": "0",
    "--top_k": "0",
    "--seed": "0",
    "--threads": "0",
}


def free_cores() -> int:
    """The cores not busy: the core count minus the 1-minute load average, at least 1."""
    return max(1, (os.cpu_count() or 1) - round(os.getloadavg()[0]))


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
    use_cache: bool = True,
) -> list[int]:
    """The new token ids after `ids` (at most `max_new_tokens`, ending at `eos_id` if it comes).

    With `cache` (a model that has `new_cache`, and `use_cache`) the prompt runs once and each new token
    runs alone against the cached keys and values; without, every token runs the model over the whole
    sequence so far. Both give the same tokens (tests/unit/tools/test_generate.py)."""
    device = next(model.parameters()).device
    tokens = torch.tensor([ids], device=device)
    cache = model.new_cache(1, len(ids) + max_new_tokens) if use_cache and hasattr(model, "new_cache") else None
    new: list[int] = []
    step = tokens
    for _ in range(max_new_tokens):
        logits = (model(step, cache=cache) if cache is not None else model(tokens))[0, -1].float()
        token = next_token(logits, temperature, top_k, generator)
        new.append(token)
        if token == eos_id:
            break
        step = torch.tensor([[token]], device=device)
        tokens = torch.cat([tokens, step], dim=1)
    return new


def load_model(
    plan: RunPlan, device: torch.device, seq_len: int, *, checkpoint: str, step: int, hf: str
) -> tuple[nn.Module, str]:
    """The plain (unparallelized) model with RoPE tables for `seq_len` positions, weights from `hf` (an HF
    folder) or a checkpoint of the run (`load_tool_weights`), and where they came from."""
    with device:
        model = plan.spec.model_cls(plan.model_args, seq_len=seq_len)
    if hf:
        import_hf(model, hf, adapter=plan.spec.require_hf_adapter(), what=f"model.flavor {plan.cfg.model.flavor!r}")
        source = f"{hf} (Hugging Face)"
    else:
        source = str(load_tool_weights(model, plan.cfg, checkpoint, step))
    return model.eval(), source


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    opts, rest = split_options(argv, OPTIONS)
    if not opts["--prompt"]:
        raise ConfigError("--prompt is required (python -m titanlite.tools.generate --help)")
    if opts["--hf"] and (opts["--checkpoint"] or opts["--step"] != "-1"):
        raise ConfigError("--hf excludes --checkpoint and --step")
    if opts["--checkpoint"] and opts["--step"] != "-1":
        raise ConfigError("--checkpoint and --step exclude each other")
    max_new, top_k, seed, threads = (
        int(number(opts, k)) for k in ("--max_new_tokens", "--top_k", "--seed", "--threads")
    )
    temperature = float(number(opts, "--temperature", float))
    if max_new < 1 or top_k < 0 or temperature < 0 or threads < 0:
        raise ConfigError("--max_new_tokens must be positive, --top_k, --temperature and --threads non-negative")
    if temperature == 0 and (top_k or seed):
        raise ConfigError("--top_k and --seed choose how to sample: they need --temperature > 0 (0 is greedy)")
    if threads or "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(threads or free_cores())
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
        model, source = load_model(
            plan, device, len(ids) + max_new, checkpoint=opts["--checkpoint"], step=int(opts["--step"]), hf=opts["--hf"]
        )
        print(f"loaded {source}", file=sys.stderr, flush=True)
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
    threads = f", {torch.get_num_threads()} CPU threads" if device.type == "cpu" else ""
    rate = f"{len(new) / seconds:.1f} tokens/s{threads}"
    print(f"generated {len(new)} tokens in {seconds:.2f} s ({rate})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    exit_now(run_tool(main))
