"""One-GPU check: a ~1B Llama 3 in bf16 with compiled blocks for a few dozen steps, and the same with
float8 linear layers; tokens/s, MFU and the peak memory against the dry run's estimate, one table.

    scripts/gpu_check.sh [--cases bf16,float8_tensorwise,float8_rowwise] [--steps 30] [--warmup 5]
        [--json FILE] [--config FILE] [--section.key value ...]

Each case (`CASES`) runs the trainer itself in a process of its own, so each peak is its own:
`Trainer(cfg)` builds the run as `python -m titanlite.train` does (a world of one: SimpleFSDP on a
one-rank mesh with fp32 master weights, bf16 compute and fp32 gradient reduction; AC and compile as
configured) and each timed step is the shipped `Trainer.train_step` on fixed random tokens, so the data
pipeline is not measured. The float8 cases convert the linear layers the config's filter keeps
(docs/float8.md): tensorwise with its weights gathered in float8, and rowwise; their MFU counts the same
FLOPs against the same bf16 peak as the bf16 case, so it reads as the bf16 case's does. A case that
fails (torchao missing: `TITANLITE_EXTRAS=float8`; a GPU without float8) is a row with its one-line
reason, and the exit code is that of the first failed case.

Without CUDA the same path runs on CPU in seconds (debug flavor, 2 x 64 tokens, aot_eager, 3 steps;
float8 emulated, every linear layer but the output projection converted, the debug model's being below
the automatic filter's sizes): its numbers say nothing about GPUs, and MFU, a GPU's figure, is left out;
it keeps the script working where there is no GPU. The CPU's peak memory is the process's resident set
(VmHWM), which also holds the Python runtime, so it is larger than the estimate of tensors alone.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from gpu_smoke import CPU_FORM as CPU_FALLBACK  # noqa: E402  the same small shape on a CPU (benchmarks/ is sys.path[0])

from titanlite.config import load_config
from titanlite.data.batch import Batch
from titanlite.errors import ConfigError, run_cli
from titanlite.metrics import MemoryMonitor, mfu_pct, peak_tflops
from titanlite.planning.memory import GiB, estimate
from titanlite.run.trainer import Trainer

CONFIG = "train_configs/llama3_1b_gpu.toml"
FLOAT8 = ["--float8.enable"]
CASES: dict[str, tuple[str, list[str]]] = {
    "bf16": ("bf16", []),
    "float8_tensorwise": (
        "float8 tensorwise + float8 all-gather",
        [*FLOAT8, "--float8.recipe", "tensorwise", "--float8.all_gather"],
    ),
    "float8_rowwise": ("float8 rowwise", [*FLOAT8, "--float8.recipe", "rowwise"]),
}
"""`--cases` name: (the table's label, the flags it adds to the config and the command line)."""
CPU_FLOAT8 = ["--float8.emulate", "--float8.filter_fqns", "output"]
"""A float8 case's flags on CPU: emulated, and every linear layer but the output projection named."""


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # one case, started by `run_case`
    parser.add_argument("--steps", type=int, default=30, help="timed steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens here)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--config", default=CONFIG)
    return parser.parse_known_args(argv)


def run(args: argparse.Namespace, overrides: list[str]) -> dict:
    """One case (`args.case`) in this process: its figures as `table` reads them."""
    label, flags = CASES[args.case]
    if not torch.cuda.is_available():
        overrides = CPU_FALLBACK + (CPU_FLOAT8 if flags else []) + overrides
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 1)
    # No TensorBoard run folder: the steps are timed here, not logged (`--metrics.enable_tensorboard` brings it back).
    overrides = [
        "--no-metrics.enable_tensorboard",
        *flags,
        *overrides,
        "--training.steps",
        str(args.warmup + args.steps),
    ]
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
        case=args.case,
        label=label,
        flags=flags,
        emulated=cfg.float8.enable and cfg.float8.emulate,
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
    )


def run_case(case: str, args: argparse.Namespace, overrides: list[str]) -> dict:
    """`run` of one case in a process of its own (its logs stream through to stderr): its result, or its
    exit code and the last line it wrote to stderr (a refusal's one line, a traceback's last)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "case.json"
        cmd = [sys.executable, __file__, "--case", case, "--json", str(out), "--config", args.config]
        cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), *overrides]
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        last = ""
        for line in proc.stderr:
            sys.stderr.write(line)
            last = line.strip() or last
        if proc.wait() == 0:
            return json.loads(out.read_text())
    return dict(case=case, label=CASES[case][0], flags=CASES[case][1], exit_code=proc.returncode, error=last)


def table(results: list[dict]) -> str:
    """A header from the first case that ran (what every case shares), then one row per case."""
    ok = [r for r in results if "error" not in r]
    lines = []
    if ok:
        r = ok[0]
        mfu = (
            f"MFU against {r['peak_tflops']:.0f} TFLOP/s ({r['peak_source']}), float8 rows too"
            if r["peak_tflops"]
            else f"MFU n/a ({r['peak_source']})"
        )
        lines += [
            f"gpu_check: {r['device']} | llama3 {r['flavor']} ({r['params'] / 1e9:.2f}B params) | "
            f"{r['dtype']} compute, compile {r['compile']}, AC {r['ac']} | batch {r['local_batch']} x {r['seq_len']} | "
            f"{r['steps']} timed steps after {r['warmup']} warm-up",
            f"{mfu}; peak memory: {r['memory_kind']}; the dry-run estimate models eager kernels' activations"
            + ("; float8 emulated on a CPU: numbers say nothing about GPUs" if any(c["emulated"] for c in ok) else ""),
            "",
        ]
    base = next((r for r in ok if r["case"] == "bf16"), None)
    lines += [
        "| case | tokens/s | x bf16 | TFLOP/s | MFU % | peak GiB | vs dry-run estimate GiB (estimate / measured) "
        "| warm-up s | final loss |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in results:
        if "error" in r:
            cells = [r["label"], f"failed (exit {r['exit_code']}): {r['error']}", *[""] * 7]
        else:
            cells = [
                r["label"],
                f"{r['tokens_per_s']:,.0f}",
                f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "n/a",
                f"{r['tflops']:.1f}",
                "n/a" if r["mfu_pct"] is None else f"{r['mfu_pct']:.1f}",
                f"{r['peak_gib']:.2f}",
                f"{r['estimate_gib']:.2f} ({r['estimate_gib'] / max(r['peak_gib'], 1e-9):.2f}; "
                f"activations {r['estimate_activations_gib']:.2f})",
                f"{r['warmup_s']:.1f}",
                f"{r['final_loss']:.4f}",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args, overrides = parse(argv)
    if args.case:
        Path(args.json).write_text(json.dumps(run(args, overrides), indent=2))
        return 0
    cases = [c for c in args.cases.split(",") if c]
    if not cases or any(c not in CASES for c in cases):
        raise ConfigError(f"--cases {args.cases!r}: each must be one of {', '.join(CASES)}")
    results = [run_case(case, args, overrides) for case in cases]
    print(table(results), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(cases=results), indent=2))
    return next((r["exit_code"] for r in results if "error" in r), 0)


if __name__ == "__main__":
    sys.exit(run_cli(main))
