"""One-GPU check: a ~1B Llama 3 in bf16 with compiled blocks for a few dozen steps; tokens/s, MFU and the
peak memory against the dry run's estimate for the same config.

    scripts/gpu_check.sh [--steps 30] [--warmup 5] [--json FILE] [--config FILE] [--section.key value ...]

It runs the trainer itself: `Trainer(cfg)` builds the run as `python -m titanlite.train` does (a world
of one: SimpleFSDP on a one-rank mesh with fp32 master weights, bf16 compute and fp32 gradient
reduction; AC and compile as configured) and each timed step is the shipped `Trainer.train_step` on
fixed random tokens, so the data pipeline is not measured.

Without CUDA the same path runs on CPU in seconds (debug flavor, 2 x 64 tokens, aot_eager, 3 steps):
its numbers say nothing about GPUs, and MFU, a GPU's figure, is left out; it keeps the script working
where there is no GPU. The CPU's peak memory is the process's resident set (VmHWM), which also holds the
Python runtime, so it is larger than the estimate of tensors alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from titanlite.config import load_config
from titanlite.data.batch import Batch
from titanlite.errors import run_cli
from titanlite.metrics import MemoryMonitor, mfu_pct, peak_tflops
from titanlite.parallelisms.memory_plan import GiB, estimate
from titanlite.trainer import Trainer

CONFIG = "train_configs/llama3_1b_gpu.toml"
CPU_FALLBACK = [
    "--model.flavor",
    "debugmodel",
    "--training.local_batch_size",
    "2",
    "--training.seq_len",
    "64",
    "--compile.backend",
    "aot_eager",
]


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens here)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--config", default=CONFIG)
    args, overrides = parser.parse_known_args(argv)
    if not torch.cuda.is_available():
        overrides = CPU_FALLBACK + overrides
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 1)
    # No TensorBoard run folder: the steps are timed here, not logged (`--metrics.enable_tensorboard` brings it back).
    overrides = ["--no-metrics.enable_tensorboard", *overrides, "--training.steps", str(args.warmup + args.steps)]
    cfg = load_config(["--config", args.config, *overrides])
    trainer = Trainer(cfg)
    plan, device, t = trainer.plan, trainer.device, cfg.training
    g = torch.Generator().manual_seed(t.seed)
    tokens = torch.randint(0, plan.model_args.vocab_size, (t.local_batch_size, t.seq_len + 1), generator=g)
    batches = [Batch.of_windows(tokens)] * plan.grad_accum

    def step() -> float:
        trainer.step += 1
        loss, _ = trainer.train_step(batches)
        return loss.item()  # waits for the device

    warm = time.perf_counter()
    for _ in range(args.warmup):
        step()
    warmup_s = time.perf_counter() - warm  # compilation happens in the first step
    memory = MemoryMonitor(device)
    start = time.perf_counter()
    losses = [step() for _ in range(args.steps)]
    elapsed = time.perf_counter() - start
    peak, _ = memory.peak_gib()
    tps = args.steps * t.local_batch_size * plan.grad_accum * t.seq_len / elapsed
    # MFU is a GPU's figure (its data-sheet peak); the CPU form leaves it out rather than divide by a CPU's.
    peak_rate, peak_source = peak_tflops(device) if device.type == "cuda" else (None, "not defined on a CPU")
    tflops = plan.model_args.flops_per_token(t.seq_len) * tps / 1e12
    layout = plan.layout()
    activations = plan.spec.planning.activation_bytes(plan.model_args, layout)
    planned = estimate(trainer.model, plan.spec.units(trainer.model), activations, layout)
    trainer.close()
    return dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        flavor=cfg.model.flavor,
        params=plan.model_args.num_params(),
        dtype=t.mixed_precision_param,
        compile=cfg.compile.backend if cfg.compile.enable else "off",
        ac=cfg.activation_checkpoint.mode,
        local_batch=t.local_batch_size,
        seq_len=t.seq_len,
        warmup=args.warmup,
        steps=args.steps,
        tokens_per_s=tps,
        tflops=tflops,
        mfu_pct=mfu_pct(tflops, peak_rate),
        peak_tflops=peak_rate,
        peak_source=peak_source,
        memory_kind=memory.kind,
        peak_gib=peak,
        estimate_gib=planned.total / GiB,
        estimate_activations_gib=planned.activations / GiB,
        final_loss=losses[-1],
        warmup_s=warmup_s,
        json=args.json,
    )


def report(r: dict) -> str:
    return "\n".join(
        [
            f"gpu_check: {r['device']} | llama3 {r['flavor']} ({r['params'] / 1e9:.2f}B params) | "
            f"{r['dtype']} compute, "
            f"compile {r['compile']}, AC {r['ac']} | batch {r['local_batch']} x {r['seq_len']}",
            f"{r['steps']} timed steps after {r['warmup']} warm-up ({r['warmup_s']:.1f} s): "
            f"{r['tokens_per_s']:,.0f} tokens/s, "
            f"{r['tflops']:.1f} TFLOP/s, MFU "
            + (
                f"{r['mfu_pct']:.1f}% of {r['peak_tflops']:.0f} TFLOP/s ({r['peak_source']})"
                if r["mfu_pct"] is not None
                else f"n/a ({r['peak_source']})"
            ),
            f"peak memory {r['peak_gib']:.2f} GiB ({r['memory_kind']}) vs dry-run estimate {r['estimate_gib']:.2f} GiB "
            f"(estimate / measured = {r['estimate_gib'] / max(r['peak_gib'], 1e-9):.2f}; "
            f"activations {r['estimate_activations_gib']:.2f} GiB of it, eager-kernel model)",
            f"final loss {r['final_loss']:.4f}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    result = run(sys.argv[1:] if argv is None else argv)
    print(report(result), flush=True)
    if result["json"]:
        with open(result["json"], "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
