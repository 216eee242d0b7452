"""Two variants compared the way a user runs them: whole `run_train.sh` launches, interleaved A B A B.

    python benchmarks/bench_launches.py --a "--compile.enable --compile.bucketing transformer_block" \
        --b "--parallelism.dp_impl fsdp2" [--pairs 2] [--from-step 11] [--out outputs/bench/launches.json] \
        [--release-freed] [-- --training.steps 30 --training.seq_len 512 ...]

Each launch is `run_train.sh` with the arguments after `--` (default `--training.steps 30 --training.seq_len
512`) plus its variant's, its own dump folder and `--metrics.log_freq 1`, so every step writes a row to
`metrics.jsonl`. Rank 0's rows from `--from-step` on (the default 11 leaves out compilation, the first
steps' allocations and the learning-rate warm-up's first steps) give the launch's medians of `tps`
(tokens/s per rank) and `mem_peak_gib`; a variant's figure is the median over its launches. The launches
alternate A, B, A, B, ... so a change in the machine's load falls on both variants alike. Everything a
launch costs a user is in it: start-up, data loading, compilation (before `--from-step`), the trainer's own
step and its metrics.

`mem_peak_gib` is what the trainer logs (`titanlite/metrics/peak_memory.py`): on CUDA the step's
`max_memory_allocated`; on CPU the rank's peak resident set (`VmHWM`, reset after every log), which holds
the whole process: the Python runtime, torch's libraries, the compiled code and inductor's caches besides
the tensors, so on CPU the ratio of two variants is diluted by a few hundred MiB both share. It also holds
what glibc's allocator keeps after a free: buffers under its dynamic mmap threshold (up to 32 MiB) return to
the heap, not to the system, so the resident set keeps the largest heap a step ever needed, however the
freed blocks fit. `--release-freed` runs every launch with `MALLOC_MMAP_THRESHOLD_=65536`: every block of
64 KiB or more is mapped on its own and returned when freed, so `mem_peak_gib` is the runtime plus what is
live. It costs tokens/s (a page fault per touched page of every new buffer), so compare throughput
without it.

Prints one line per launch and a table with B's ratios to A (and A's to B); writes the JSON to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_COMMON = ["--training.steps", "30", "--training.seq_len", "512"]


def launch(variant: list[str], common: list[str], from_step: int, env: dict[str, str]) -> dict:
    """Run one launch; its medians from `from_step` on, its wall seconds and the rows used."""
    dump = tempfile.mkdtemp(prefix="bench_launch_")
    cmd = [str(ROOT / "run_train.sh"), *common, *variant, "--job.dump_folder", dump, "--metrics.log_freq", "1"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **env})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"launch failed (exit {proc.returncode}): {shlex.join(cmd)}\n{proc.stderr[-2000:]}")
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "tps" in r and r["step"] >= from_step]
    if not rows:
        sys.exit(f"no metrics rows from step {from_step} in {dump}")
    return {
        "tps": statistics.median(r["tps"] for r in rows),
        "mem_peak_gib": statistics.median(r["mem_peak_gib"] for r in rows),
        "steps": [rows[0]["step"], rows[-1]["step"]],
        "wall_s": round(wall, 1),
        "dump_folder": dump,
    }


def main(argv: list[str]) -> int:
    own, common = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", required=True, help="variant A's arguments (one string)")
    parser.add_argument("--b", required=True, help="variant B's arguments (one string)")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--from-step", type=int, default=11)
    parser.add_argument("--out", default="outputs/bench/launches.json")
    parser.add_argument(
        "--release-freed",
        action="store_true",
        help="launch with MALLOC_MMAP_THRESHOLD_=65536: freed buffers go back to the system (memory runs)",
    )
    args = parser.parse_args(own)
    env = {"MALLOC_MMAP_THRESHOLD_": "65536"} if args.release_freed else {}
    common = common or DEFAULT_COMMON
    variants = {"A": shlex.split(args.a), "B": shlex.split(args.b)}
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    for i in range(args.pairs):
        for name, variant in variants.items():
            r = launch(variant, common, args.from_step, env)
            runs[name].append(r)
            print(
                f"pair {i + 1} {name}: {r['tps']:,.0f} tokens/s, {r['mem_peak_gib']:.3f} GiB "
                f"(steps {r['steps'][0]}-{r['steps'][1]}, launch {r['wall_s']:.0f} s)",
                flush=True,
            )
    med = {n: {k: statistics.median(r[k] for r in rs) for k in ("tps", "mem_peak_gib")} for n, rs in runs.items()}
    allocator = ", freed buffers released (MALLOC_MMAP_THRESHOLD_=65536)" if args.release_freed else ""
    print(
        f"\n{shlex.join(common)}, {args.pairs} launches each, medians of steps {args.from_step}+ per launch"
        f"{allocator}\n"
    )
    print("| variant | arguments | tokens/s | x A | mem_peak_gib | x A |")
    print("|---|---|---:|---:|---:|---:|")
    for name in variants:
        m = med[name]
        print(
            f"| {name} | `{shlex.join(variants[name])}` | {m['tps']:,.0f} | {m['tps'] / med['A']['tps']:.2f} | "
            f"{m['mem_peak_gib']:.3f} | {m['mem_peak_gib'] / med['A']['mem_peak_gib']:.2f} |"
        )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"common": common, "env": env, "variants": variants, "runs": runs, "medians": med}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
