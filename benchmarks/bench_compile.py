"""SimpleFSDP eager / compiled / bucketed against FSDP2, in one torchrun launch.

    MALLOC_MMAP_THRESHOLD_=1048576 OMP_NUM_THREADS=1 PYTHONPATH=. \
        python -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/bench_compile.py [--steps 6]

Every variant is the trainer itself (`Trainer(cfg, plan)`: `titanlite.run.build` with this benchmark's model;
compiled variants also compile the loss), stepped by the shipped `Trainer.train_step`, and warmed up
first. Its first step compiles: the compile time shown is that step minus a warm one, from an inductor
cache that starts empty (variants built later reuse C++ kernels that earlier ones compiled, so theirs is
a lower bound). Then the variants are timed interleaved, one step each per round, so that load from
other processes hits them alike; tokens/s is the global batch over the median step time.
Peak memory is the rank's parameters, gradients and optimizer state plus the largest growth of memory in
use during a timed step: on CPU the resident set (VmHWM after a reset through /proc/self/clear_refs,
glibc's free memory trimmed first; with MALLOC_MMAP_THRESHOLD_ large tensors are mmapped and returned
when freed), on CUDA the allocator's peak. All variants live in one process, hence growth, not the
absolute peak. Collectives per step are counted by the profiler (`c10d::*` events: every all-gather,
reduce-scatter and all-reduce that reaches the process group, eager or compiled; the all-reduces are the
gradient-norm clipping's and the trainer's agreement on a finite step). Rank 0 prints a markdown table.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from titanlite.config import JobConfig
from titanlite.data.batch import Batch
from titanlite.models.llama3 import ModelArgs
from titanlite.planning.run_plan import RunPlan
from titanlite.run.build import init_device, init_distributed
from titanlite.run.trainer import Trainer

# 8 blocks of dim 256 and a 2k vocabulary: 7.0M parameters in 75 tensors. Unbucketed, a step issues 214
# collectives (all-gathers, re-gathers, reduce-scatters) of ~100-250 us fixed cost each on gloo loopback
# plus ~56 MB of all-gather/reduce-scatter buffers: at seq 256 x batch 2 per rank, communication is a
# sizeable part of a ~1 s CPU step.
ARGS = ModelArgs(dim=256, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=2048, multiple_of=64, max_seq_len=256)
VARIANTS = {
    "SimpleFSDP eager": dict(dp_impl="simple_fsdp"),
    "SimpleFSDP compiled": dict(dp_impl="simple_fsdp", compile=True),
    "SimpleFSDP compiled + auto": dict(dp_impl="simple_fsdp", compile=True, bucketing="auto"),
    "SimpleFSDP compiled + transformer_block": dict(dp_impl="simple_fsdp", compile=True, bucketing="transformer_block"),
    "SimpleFSDP compiled (model) + transformer_block": dict(
        dp_impl="simple_fsdp", compile=True, bucketing="transformer_block", scope="model"
    ),
    "SimpleFSDP compiled (model) + transformer_block (no reorder)": dict(
        dp_impl="simple_fsdp", compile=True, bucketing="transformer_block", scope="model", reorder=False
    ),
    "FSDP2 eager": dict(dp_impl="fsdp2"),
    "FSDP2 compiled": dict(dp_impl="fsdp2", compile=True),
}
BASELINE = "FSDP2 eager"
KINDS = (("allgather", "ag"), ("reduce_scatter", "rs"), ("allreduce", "ar"))


@dataclass
class Variant:
    name: str
    cfg: JobConfig
    trainer: Trainer
    times: list[float] = field(default_factory=list)
    compile_s: float = 0.0
    growth: int = 0
    collectives: Counter[str] = field(default_factory=Counter)


def build(name: str, opts: dict, world: int, dump_root: str, seq: int, batch: int) -> Variant:
    """The trainer itself (`Trainer(cfg, plan)` with this benchmark's model) for one variant."""
    cfg = JobConfig()
    cfg.training.mixed_precision_param = "float32"
    cfg.parallelism.dp_impl = opts["dp_impl"]
    cfg.compile.enable = opts.get("compile", False)
    cfg.compile.backend = "inductor"
    cfg.compile.bucketing = opts.get("bucketing", "none")
    cfg.compile.scope = opts.get("scope", "block")
    cfg.compile.reorder = opts.get("reorder", True)
    cfg.job.dump_folder = os.path.join(dump_root, name.replace(" ", "_").replace("+", "p"))
    cfg.training.seq_len, cfg.training.local_batch_size, cfg.training.steps = seq, batch, 10_000
    cfg.metrics.enable_tensorboard = False
    return Variant(name, cfg, Trainer(cfg, RunPlan.build(cfg, world, args=ARGS)))


def step(v: Variant, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> float:
    t0 = time.perf_counter()
    v.trainer.step += 1
    v.trainer.train_step([batch])
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def state_bytes(v: Variant) -> int:
    """Local parameters, gradients and optimizer state."""
    params = list(v.trainer.model.parameters())
    tensors = params + [p.grad for p in params if p.grad is not None]
    tensors += [t for s in v.trainer.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in tensors)


class MemoryProbe:
    """Growth of memory in use over its level at `start()`: the CUDA allocator or the CPU resident set."""

    def __init__(self, device: torch.device):
        self.device, self.base = device, 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.base = _status_bytes("VmRSS")

    def growth(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.base
        return _status_bytes("VmHWM") - self.base


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return 1024 * next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def count_collectives(v: Variant, batch, device: torch.device) -> Counter[str]:
    """Process-group collectives of one step as the profiler records them (`c10d::*` ops reach the backend
    from eager and compiled code alike), by kind."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(v, batch, device)
    counts: Counter[str] = Counter()
    for event in prof.events():
        if event.name.startswith("c10d::"):
            counts[next((short for key, short in KINDS if key in event.name), "other")] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6, help="timed rounds; each round times one step per variant")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2, help="local batch per rank")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of the names")
    args = parser.parse_args()

    device = init_device()  # the trainer's device and process group (`titanlite.run.build`), shared by the variants
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    group_cfg = JobConfig()
    group_cfg.comm.init_timeout_seconds = 1800  # all steps run under it: first steps compile for minutes
    init_distributed(group_cfg, device)
    world, rank = dist.get_world_size(), dist.get_rank()
    cache = tempfile.mkdtemp(prefix="bench_inductor_") if rank == 0 else ""
    box = [cache]
    dist.broadcast_object_list(box)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = box[0]  # cold compiles, shared by the ranks
    g = torch.Generator().manual_seed(1234 + rank)
    tokens = torch.randint(0, ARGS.vocab_size, (args.batch, args.seq + 1), generator=g).to(device)
    batch = Batch.of_windows(tokens)

    names = [n for n in VARIANTS if n in args.variants.split(",")]
    variants = []
    for name in names:
        v = build(name, VARIANTS[name], world, box[0], args.seq, args.batch)
        warm = [step(v, batch, device) for _ in range(args.warmup + 1)]
        v.compile_s = warm[0] - statistics.median(warm[1:])
        variants.append(v)
        if rank == 0:
            print(f"built {name}: first step {warm[0]:.1f} s", file=sys.stderr, flush=True)
    probe = MemoryProbe(device)
    for _ in range(args.steps):
        for v in variants:
            probe.start()
            v.times.append(step(v, batch, device))
            v.growth = max(v.growth, probe.growth())
    for v in variants:
        v.collectives = count_collectives(v, batch, device)

    if rank == 0:
        tokens_per_step = args.batch * args.seq * world
        base = next((v for v in variants if v.name == BASELINE), None)
        print(
            f"\n{ARGS.num_params() / 1e6:.1f}M params, {ARGS.n_layers} blocks, dim {ARGS.dim}, seq {args.seq}, "
            f"local batch {args.batch}, {world} ranks ({device.type}), median of {args.steps} interleaved steps\n"
        )
        print(
            "| variant | tokens/s | vs FSDP2 eager | peak memory (MiB) | vs FSDP2 eager "
            "| collectives/step (ag/rs/ar) | compile (s) |"
        )
        print("|---|---:|---:|---:|---:|---|---:|")
        peak = {v.name: state_bytes(v) + v.growth for v in variants}
        for v in variants:
            tps = tokens_per_step / statistics.median(v.times)
            base_tps = tokens_per_step / statistics.median(base.times) if base else float("nan")
            mem_ratio = peak[v.name] / peak[BASELINE] if base else float("nan")
            c = v.collectives
            print(
                f"| {v.name} | {tps:,.0f} | {tps / base_tps:.2f}x | {peak[v.name] / 2**20:.0f} | {mem_ratio:.2f}x "
                f"| {sum(c.values())} ({c['ag']}/{c['rs']}/{c['ar']}) | {max(v.compile_s, 0.0):.1f} |"
            )
    for v in variants:
        v.trainer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
