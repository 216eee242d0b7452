"""Compile time and peak host memory of the debug model's width at several depths: one forward and
backward, inductor, transformer_block bucketing, SimpleFSDP over 2 ranks of torch's fake process group,
cold inductor cache, each depth in a fresh process.

    PYTHONPATH=. python benchmarks/bench_compile_time.py [--blocks 6,24,48] [--backend inductor]
        [--scope auto|block|model] [--ac none|full|selective]

Prints, per depth, the wall time of the first forward + backward (compiles included), the compile
report's compile seconds (time in the compile backends: AOTAutograd, partitioning, the graph passes,
codegen), its number of traced graphs, the scope `auto` resolved to, and the process's peak resident
memory (`ru_maxrss` of the child that built and compiled that depth alone: the Python runtime, torch and
the model's weights are in it too, so compare rows, not absolute values). Inductor compiles in that
process (`compile_threads = 1`): with a pool of compile workers their memory and part of the time would
sit in other processes. With `--scope block` (or `auto`) identical blocks share one trace, so depth adds
little beyond running the blocks; `--scope model` compiles one graph of every block, whose compile time
and memory grow with depth.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_depth(n: int, args: argparse.Namespace) -> dict:
    """Compile and run depth `n` in this process; the figures of `main`'s table."""
    sys.path.insert(0, str(ROOT))
    from torch._inductor import config as inductor_config

    from titanlite.config import JobConfig
    from titanlite.models.llama3.flavors import llama3_configs
    from titanlite.tools.dry_run import compile_report

    inductor_config.compile_threads = 1
    cfg = JobConfig()
    cfg.training.mixed_precision_param = "float32"
    cfg.compile.enable, cfg.compile.backend, cfg.compile.bucketing = True, args.backend, args.bucketing
    cfg.compile.scope, cfg.activation_checkpoint.mode = args.scope, args.ac
    cfg.job.dump_folder = tempfile.mkdtemp(prefix="compile_time_dump_")
    model_args = dataclasses.replace(llama3_configs["debugmodel"], n_layers=n, vocab_size=2048)
    t0 = time.perf_counter()
    report = compile_report(cfg, 2, model_args, seq_len=256)
    wall = time.perf_counter() - t0
    return {
        "blocks": n,
        "scope": report["scope"],
        "wall_s": round(wall, 1),
        "compile_s": report["compile_seconds"],
        "traces": report.get("traces", report["units"]),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "prefetched_all_gathers": report["prefetched_all_gathers"],
        "overlapped_reduce_scatters": report["overlapped_reduce_scatters"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", default="6,24,48")
    parser.add_argument("--backend", default="inductor", choices=["aot_eager", "inductor"])
    parser.add_argument("--bucketing", default="transformer_block")
    parser.add_argument("--scope", default="auto", choices=["auto", "block", "model", "prefetch"])
    parser.add_argument("--ac", default="full", choices=["none", "full", "selective"])
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child's depth
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one_depth(args.one, args)))
        return
    print(f"scope {args.scope}, AC {args.ac}, {args.backend}, {args.bucketing} bucketing")
    print("| blocks | scope | first fwd+bwd (s) | compile (s) | traced graphs | peak RSS (MiB) | overlap ag / rs |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for n in (int(b) for b in args.blocks.split(",")):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="compile_time_")}
        child = [sys.executable, __file__, *sys.argv[1:], "--one", str(n)]
        out = subprocess.run(child, env=env, check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(
            f"| {n} | {r['scope']} | {r['wall_s']:.1f} | {r['compile_s']:.1f} | {r['traces']} | "
            f"{r['peak_rss_mib']:,} | {r['prefetched_all_gathers']} / {r['overlapped_reduce_scatters']} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
