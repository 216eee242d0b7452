"""One-GPU check: a ~1B Llama 3 in bf16 with compiled blocks for a few dozen steps; tokens/s, MFU and the
peak memory against the dry run's estimate for the same config.

    scripts/gpu_check.sh [--steps 30] [--warmup 5] [--json FILE] [--config FILE] [--section.key value ...]

The model is built as the trainer builds it (meta device, `parallelize_llama`: AC and compile) and then
wrapped by SimpleFSDP on a one-rank mesh: the trainer applies mixed precision (fp32 master weights, bf16
compute, fp32 gradient reduction) only through data parallelism, which a single process does not get.
Steps are `titanlite.step.training_step` on fixed random tokens, so the data pipeline is not measured.

Without CUDA the same path runs on CPU in seconds (debug flavor, 2 x 64 tokens, aot_eager, 3 steps):
its numbers say nothing about GPUs; it keeps the script working where there is no GPU. The CPU peak is
the process's resident set (VmHWM), which also holds the Python runtime, so it is larger than the
estimate of tensors alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch
import torch.distributed as dist

from titanlite.config import load_config
from titanlite.memory_plan import DTYPES, GiB, Layout, estimate
from titanlite.metrics import MemoryMonitor, peak_tflops
from titanlite.models.llama3 import Transformer
from titanlite.models.llama3.parallelize import apply_simple_fsdp_reshard, parallelize_llama
from titanlite.optim import build_lr_scheduler, build_optimizer
from titanlite.parallelisms.simple_fsdp import MixedPrecisionPolicy, data_parallel
from titanlite.step import cross_entropy_loss, training_step
from titanlite.train import RunPlan

CONFIG = "train_configs/llama3_1b_gpu.toml"
CPU_FALLBACK = ["--model.flavor", "debugmodel", "--training.local_batch_size", "2", "--training.seq_len", "64",
                "--compile.backend", "aot_eager"]


def build(cfg, device: torch.device):
    """(model, plan, layout): the trainer's construction plus one-rank SimpleFSDP for mixed precision."""
    plan = RunPlan.build(cfg, 1)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1, device_id=device if device.type == "cuda" else None)
    mesh = plan.dims.build_mesh(device.type)
    with torch.device("meta"):
        model = Transformer(plan.model_args, seq_len=cfg.training.seq_len)
    model = parallelize_llama(model, plan.dims, cfg)
    t = cfg.training
    data_parallel(model, mesh, "fully_shard",
                  MixedPrecisionPolicy(DTYPES[t.mixed_precision_param], DTYPES[t.mixed_precision_reduce]))
    apply_simple_fsdp_reshard(model, cfg.parallelism.fsdp_reshard_after_forward, "fully_shard")
    model.to_empty(device=device)
    model.init_weights(seed=t.seed, buffer_device=device)
    model.train()
    layout = dataclasses.replace(Layout.from_config(cfg, plan.dims), dp_mode="fully_shard",
                                 compute_dtype=DTYPES[t.mixed_precision_param],
                                 reduce_dtype=DTYPES[t.mixed_precision_reduce])
    return model, plan, layout


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens here)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--config", default=CONFIG)
    args, overrides = parser.parse_known_args(argv)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        overrides = CPU_FALLBACK + overrides
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 1)
    else:
        torch.cuda.set_device(device)
    cfg = load_config(["--config", args.config, *overrides])
    model, plan, layout = build(cfg, device)
    optimizer = build_optimizer(model, cfg.optimizer)
    scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, args.warmup + args.steps)
    t = cfg.training
    g = torch.Generator().manual_seed(t.seed)
    tokens = torch.randint(0, plan.model_args.vocab_size, (t.local_batch_size, t.seq_len + 1), generator=g)
    batches = [(tokens[:, :-1], tokens[:, 1:])]

    def step() -> float:
        loss, _ = training_step(model, optimizer, scheduler, batches, cross_entropy_loss, False, t.max_norm, device)
        return loss.item()  # waits for the device

    for _ in range(args.warmup):
        step()
    memory = MemoryMonitor(device)
    start = time.perf_counter()
    losses = [step() for _ in range(args.steps)]
    elapsed = time.perf_counter() - start
    peak, _ = memory.peak_gib()
    tps = args.steps * t.local_batch_size * t.seq_len / elapsed
    peak_rate, peak_source = peak_tflops(device)
    tflops = plan.model_args.flops_per_token(t.seq_len) * tps / 1e12
    planned = estimate(model, plan.model_args, layout)
    dist.destroy_process_group()
    return dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", flavor=cfg.model.flavor,
        params=plan.model_args.num_params(), dtype=t.mixed_precision_param,
        compile=cfg.compile.backend if cfg.compile.enable else "off", ac=cfg.activation_checkpoint.mode,
        local_batch=t.local_batch_size, seq_len=t.seq_len, warmup=args.warmup, steps=args.steps,
        tokens_per_s=tps, tflops=tflops, mfu_pct=100 * tflops / peak_rate, peak_tflops=peak_rate,
        peak_source=peak_source, memory_kind=memory.kind, peak_gib=peak, estimate_gib=planned.total / GiB,
        estimate_activations_gib=planned.activations / GiB, final_loss=losses[-1], json=args.json,
    )


def report(r: dict) -> str:
    return "\n".join([
        f"gpu_check: {r['device']} | llama3 {r['flavor']} ({r['params'] / 1e9:.2f}B params) | {r['dtype']} compute, "
        f"compile {r['compile']}, AC {r['ac']} | batch {r['local_batch']} x {r['seq_len']}",
        f"{r['steps']} timed steps after {r['warmup']} warm-up: {r['tokens_per_s']:,.0f} tokens/s, "
        f"{r['tflops']:.1f} TFLOP/s, MFU {r['mfu_pct']:.1f}% of {r['peak_tflops']:.0f} TFLOP/s ({r['peak_source']})",
        f"peak memory {r['peak_gib']:.2f} GiB ({r['memory_kind']}) vs dry-run estimate {r['estimate_gib']:.2f} GiB "
        f"(estimate / measured = {r['estimate_gib'] / max(r['peak_gib'], 1e-9):.2f}; "
        f"activations {r['estimate_activations_gib']:.2f} GiB of it, eager-kernel model)",
        f"final loss {r['final_loss']:.4f}",
    ])


def main(argv: list[str] | None = None) -> int:
    result = run(sys.argv[1:] if argv is None else argv)
    print(report(result), flush=True)
    if result["json"]:
        with open(result["json"], "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
