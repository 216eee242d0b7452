"""Compile time of the debug model's width at several depths: one forward and backward, inductor,
transformer_block bucketing, SimpleFSDP over 2 ranks of torch's fake process group, cold inductor cache.

    PYTHONPATH=. python benchmarks/bench_compile_time.py [--blocks 6,32] [--backend inductor] [--scope block]
        [--ac none]

Prints, per depth, the wall time of the first forward + backward (compiles included) and the compile
report's compile seconds and number of traced graphs. With `--scope block` identical blocks share one
trace, so depth should add little beyond running the blocks; `--scope model` compiles one graph of every
block, whose compile time grows with depth.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time

from titanlite.config import JobConfig
from titanlite.models.llama3.flavors import llama3_configs
from titanlite.tools.dry_run import compile_report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", default="6,32")
    parser.add_argument("--backend", default="inductor", choices=["aot_eager", "inductor"])
    parser.add_argument("--bucketing", default="transformer_block")
    parser.add_argument("--scope", default="block", choices=["auto", "block", "model"])
    parser.add_argument("--ac", default="none", choices=["none", "full", "selective"])
    args = parser.parse_args()
    print("| blocks | first fwd+bwd (s) | compile (s) | traced graphs |")
    print("|---:|---:|---:|---:|")
    for n in (int(b) for b in args.blocks.split(",")):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="compile_time_")
        cfg = JobConfig()
        cfg.training.mixed_precision_param = "float32"
        cfg.compile.enable, cfg.compile.backend, cfg.compile.bucketing = True, args.backend, args.bucketing
        cfg.compile.scope, cfg.activation_checkpoint.mode = args.scope, args.ac
        cfg.job.dump_folder = tempfile.mkdtemp(prefix="compile_time_dump_")
        model_args = dataclasses.replace(llama3_configs["debugmodel"], n_layers=n, vocab_size=2048)
        t0 = time.perf_counter()
        report = compile_report(cfg, 2, model_args, seq_len=256)
        wall = time.perf_counter() - t0
        print(f"| {n} | {wall:.1f} | {report['compile_seconds']:.1f} | {report.get('traces', report['units'])} |")


if __name__ == "__main__":
    main()
