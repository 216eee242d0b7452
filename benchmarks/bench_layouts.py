"""The layout search's step-time model against measured step times: layouts of the debug model on 4 gloo
ranks, ranked by estimate and by measurement (Spearman rank correlation), one launch.

    python benchmarks/bench_layouts.py [--rounds 3] [--steps 3] [--warmup 2] [--out outputs/bench/layouts.json]
        [--config FILE] [--section.key value ...]

The launch (torchrun, 4 ranks) first measures this machine as the step-time model's "GPU kind", every
rank at once as in training: the matmul rate at the model's shapes, the attention (SDPA forward and
backward) rate, the copy bandwidth, and gloo's all-gather bandwidth and latency over the 4 ranks. Then
every layout below is built by the trainer itself and stepped with the shipped `Trainer.train_step`
(`bench_suite.Variant`), in interleaved rounds; the median step time is its measurement. After the
launch this process estimates each layout with `titanlite.planning.step_time` on the measured kind (the layout
search's `given` estimate of that config) and prints both rankings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_suite import rounds_parser  # noqa: E402

from titanlite.config import DEFAULT_CONFIG, load_config  # noqa: E402
from titanlite.run.build import init_device, init_distributed  # noqa: E402

NPROC = 4
P = "--parallelism."
LAYOUTS: dict[str, list[str]] = {
    "dp_shard 4": [],
    "dp_shard 4, full AC": ["--activation_checkpoint.mode", "full"],
    "dp_shard 4, reshard never": [P + "fsdp_reshard_after_forward", "never"],
    "dp_shard 2 x tp 2": [P + "tensor_parallel_degree", "2"],
    "tp 4": [P + "tensor_parallel_degree", "4"],
    "dp_replicate 4": [P + "data_parallel_replicate_degree", "4", P + "data_parallel_shard_degree", "1"],
    "dp_replicate 2 x dp_shard 2": [P + "data_parallel_replicate_degree", "2", P + "data_parallel_shard_degree", "2"],
    "pp 2 x dp_shard 2, 1F1B": [P + "pipeline_parallel_degree", "2"],
    "pp 2 x tp 2, 1F1B": [P + "pipeline_parallel_degree", "2", P + "tensor_parallel_degree", "2"],
    "pp 4, 1F1B": [P + "pipeline_parallel_degree", "4"],
}
"""Layout -> overrides of the base config (4 ranks, the same global batch)."""


def _best(fn, reps: int = 5) -> float:
    fn()
    out = float("inf")
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out


def measure_machine(dim: int, ffn: int, heads: int, tokens: int, seq: int) -> dict[str, float]:
    """This machine's figures as every rank sees them while all ranks compute (averaged over the ranks)."""
    a, b = torch.randn(tokens, dim), torch.randn(dim, ffn)
    mm = 2 * tokens * dim * ffn * 4 / _best(lambda: [a @ b for _ in range(4)])
    hd = dim // heads
    q = torch.randn(tokens // seq, heads, seq, hd, requires_grad=True)
    k, v = torch.randn_like(q, requires_grad=True), torch.randn_like(q, requires_grad=True)

    def attention() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    attn_flops = 2 * 2 * (tokens // seq) * heads * seq * seq * hd / 2 * 3.5  # causal; forward + 2.5x backward
    attn = attn_flops / _best(attention)
    big = torch.empty(8 * 2**20)
    copy = 2 * big.nbytes / _best(lambda: big.clone())
    p = dist.get_world_size()
    wide = torch.zeros(2**18)
    # The cost of one collective as SimpleFSDP issues them (DTensor redistribute -> functional all-gather),
    # back to back, the mean: on ranks that share cores every collective also waits for the slowest rank.
    mesh = init_device_mesh("cpu", (p,))
    small = distribute_tensor(torch.zeros(p * 16), mesh, [Shard(0)])
    n = 50
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        small.redistribute(mesh, [Replicate()]).to_local()
    latency = (time.perf_counter() - t0) / n
    t_wide = _best(lambda: dist.all_gather_into_tensor(torch.empty(p * wide.numel()), wide), reps=10)
    gloo = (p - 1) * wide.nbytes / max(t_wide - latency, 1e-9)
    figures = torch.tensor([mm, attn, copy, gloo, latency], dtype=torch.float64)
    dist.all_reduce(figures)
    figures /= p
    return dict(
        zip(("matmul_flops", "attention_flops", "copy_bytes_per_s", "gloo_bytes_per_s", "latency_s"), figures.tolist())
    )


def worker(args: argparse.Namespace, overrides: list[str]) -> None:
    from bench_suite import Variant  # the trainer-built variant of the data-parallel suite

    dump = str(Path(args.out).parent / "layout_runs")
    base = ["--config", args.config, "--job.dump_folder", dump, "--no-metrics.enable_tensorboard", *overrides]
    base_cfg = load_config(base)
    device = init_device()
    init_distributed(base_cfg, device)
    rank = dist.get_rank()
    t = base_cfg.training
    global_batch = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * NPROC
    probe = load_config([*base, P + "data_parallel_shard_degree", str(NPROC)])
    from titanlite.planning.run_plan import RunPlan

    args_ = RunPlan.build(probe, NPROC).model_args
    machine = measure_machine(args_.dim, args_.ffn_hidden_dim, args_.n_heads, t.local_batch_size * t.seq_len, t.seq_len)
    variants, times = {}, {}
    for name, extra in LAYOUTS.items():
        cfg = load_config([*base, *extra, "--training.global_batch_size", str(global_batch)])
        variants[name] = Variant(cfg, device)
        for _ in range(args.warmup):
            variants[name].step()
        times[name] = []
        if rank == 0:
            print(f"bench_layouts: {name} ready", flush=True)
    for _ in range(args.rounds):
        for name, variant in variants.items():
            dist.barrier()
            for _ in range(args.steps):
                start = time.perf_counter()
                variant.step()
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        record = dict(
            world=NPROC,
            global_batch=global_batch,
            base=base,
            machine=machine,
            args=vars(args),
            layouts={name: dict(overrides=LAYOUTS[name], step_times_s=times[name]) for name in LAYOUTS},
        )
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=2))
    for variant in variants.values():
        variant.trainer.close()
    dist.destroy_process_group()


def cpu_kind(machine: dict[str, float]):
    """The measured machine as a GPU kind: every rate as measured (the model's efficiencies divided out),
    one node of the 4 ranks sharing this machine's cores, collectives that do not overlap compute (gloo
    runs on the same cores)."""
    from titanlite.planning.gpus import COLLECTIVE_EFFICIENCY, HBM_EFFICIENCY, GpuKind

    mm = machine["matmul_flops"] / 1e12
    gloo = machine["gloo_bytes_per_s"] / 1e9 / COLLECTIVE_EFFICIENCY
    return GpuKind(
        "cpu",
        "this CPU, 4 gloo ranks (measured)",
        24.0,
        mm,
        mm,
        mm,
        machine["attention_flops"] / 1e12,
        machine["copy_bytes_per_s"] / 1e9 / HBM_EFFICIENCY,
        gloo,
        gloo,
        gpus_per_node=NPROC,
        training_efficiency=1.0,
        comm_overlaps_compute=False,
        intra_latency_s=machine["latency_s"],
        inter_latency_s=machine["latency_s"],
        shared_processors=os.cpu_count() or 1,
    )


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties averaged."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks."""
    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def report(record: dict) -> str:
    from titanlite.planning.layout_search import Estimate, LayoutSearch
    from titanlite.tools.dry_run import meta_model

    kind = cpu_kind(record["machine"])
    rows = []
    for name, lay in record["layouts"].items():
        cfg = load_config(
            [*record["base"], *lay["overrides"], "--training.global_batch_size", str(record["global_batch"])]
        )
        est = LayoutSearch(cfg, record["world"], kind, meta_model).given()
        assert isinstance(est, Estimate), est
        rows.append((name, statistics.median(lay["step_times_s"]), est.time))
    measured, estimated = [r[1] for r in rows], [r[2].step for r in rows]
    m = record["machine"]
    lines = [
        f"{record['world']} gloo ranks, measured: matmul {m['matmul_flops'] / 1e9:.1f} GFLOP/s, attention "
        f"{m['attention_flops'] / 1e9:.1f} GFLOP/s, copy {m['copy_bytes_per_s'] / 1e9:.2f} GB/s, all-gather "
        f"{m['gloo_bytes_per_s'] / 1e9:.2f} GB/s per rank, latency {1e6 * m['latency_s']:.0f} us (per rank, all "
        "ranks busy)",
        "",
        "| layout | measured step s | rank | estimated step s | rank | est / measured | est. compute / comm s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    rm, re = ranks(measured), ranks(estimated)
    for (name, meas, t), a, b in zip(rows, rm, re):
        lines.append(
            f"| {name} | {meas:.3f} | {a:g} | {t.step:.3f} | {b:g} | {t.step / meas:.2f} | "
            f"{t.compute + t.recompute:.3f} / {t.exposed_comm:.3f} |"
        )
    lines += [
        "",
        f"Spearman rank correlation (estimated vs measured step time, {len(rows)} layouts): "
        f"{spearman(estimated, measured):.2f}",
    ]
    return "\n".join(lines)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = rounds_parser(__doc__, "layout", steps=3, warmup=2)
    parser.add_argument("--out", default="outputs/bench/layouts.json")
    parser.add_argument("--config", default=str(ROOT / DEFAULT_CONFIG))
    parser.add_argument("--report-only", action="store_true", help="estimate and print from an existing --out")
    return parser.parse_known_args(argv)


def main(argv: list[str]) -> int:
    args, overrides = parse(argv)
    if "LOCAL_RANK" in os.environ:
        worker(args, overrides)
        return 0
    if not args.report_only:
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={NPROC}",
            "--local-ranks-filter",
            "0",
            __file__,
            *argv,
        ]
        rc = subprocess.run(cmd, env=env, cwd=ROOT).returncode
        if rc:
            return rc
    print(report(json.loads(Path(args.out).read_text())), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
