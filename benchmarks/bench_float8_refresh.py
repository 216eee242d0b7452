"""The per-step refresh of the float8 weight gathers (`float8.all_gather`): kernels and temporary memory.

    python benchmarks/bench_float8_refresh.py [--layers 8,32,128,512] [--world 2]
                                              [--plan train_configs/llama3_70b.toml] [--plan-world 64]
                                              [--device cpu|cuda]

Builds the debug model with `--layers` blocks as rank 0 of a `--world`-rank run (torch's fake process
group: the one all-reduce does nothing), SimpleFSDP, fp32 master weights computed in bf16, every linear
layer but the output in float8 with its weight gathered as float8, and refreshes its float8 shards once
with `Float8Gathers.refresh` and once with the per-weight loop it replaces (written out below: each shard
copied to bf16, all copies held, then ~10 kernels per weight). Prints a markdown table: the aten
operations each dispatches that compute (a `TorchDispatchMode` count, views and bare allocations
excluded; a `_foreach_` op counts once: on CUDA its tensors share a few launches), and the peak of the
temporaries they allocate (`torch.profiler`'s allocation and free events, replayed in order); both
write the same bits and scales (checked). A last row plans `--plan` at `--plan-world` ranks (tp 1) on
the meta device, as the dry run does: its float8 weights and the refresh's chunks, the ops priced per
weight and per chunk by the measured rows. `--device cuda` builds and refreshes on the GPU and counts
the CUDA kernels the profiler records and the allocator's peak instead (with `float8.emulate` as on the
CPU: the refresh casts whatever the matmuls do).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from titanlite.config import JobConfig
from titanlite.models.llama3 import llama3_configs
from titanlite.parallelisms.float8.gather import CAST_CHUNK_BYTES, Float8Gathers, float8_gathers_of
from titanlite.planning.run_plan import RunPlan
from titanlite.run.build import build_model
from titanlite.tools.dry_run import fake_process_group

_ALLOCATIONS = (torch.ops.aten.empty, torch.ops.aten.empty_strided)


class OpCount(TorchDispatchMode):
    """Aten operations that compute: views and bare allocations excluded."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += not func.is_view and func.overloadpacket not in _ALLOCATIONS
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def per_weight(gathers: Float8Gathers) -> None:
    """The refresh as one loop over the weights: every shard's bf16 copy alive at once, ~10 kernels each."""
    from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

    shards = [layer._parameters["weight"].to_local().to(wire.compute_dtype) for wire, layer in gathers.wires]
    amax = torch.stack(torch._foreach_norm(shards, ord=math.inf)).float()
    if gathers.group is not None:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=gathers.group)
    for (wire, _), shard, value in zip(gathers.wires, shards, amax):
        scale = amax_to_scale(value, wire.float8_dtype, wire.round_scales)
        wire.scale.copy_(scale)
        wire.bits.copy_(to_fp8_saturated(shard.to(torch.float32) * scale, wire.float8_dtype).view(torch.uint8))


def measure(fn: Any, device: torch.device) -> tuple[int, int]:
    """(operations, peak bytes of the temporaries) of one call of `fn`. CPU: the aten operations that
    compute and the profiler's allocations; CUDA: the kernels the profiler records and the allocator's peak
    above what was allocated before."""
    if device.type == "cuda":
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize(device)
        kernels = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return kernels, torch.cuda.max_memory_allocated(device) - base
    with OpCount() as count:
        fn()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):  # each allocation (+) and free (-), in order
        live += e.nbytes()
        peak = max(peak, live)
    return count.ops, peak


@dataclasses.dataclass
class Row:
    blocks: int
    weights: int
    local: int
    """Elements of the float8 weights' shards on the rank."""
    chunks: int
    before: tuple[int, int] = (0, 0)
    """(ops, peak temporary bytes) of the per-weight loop."""
    after: tuple[int, int] = (0, 0)
    """The same of `Float8Gathers.refresh`."""


def measured(layers: int, world: int, device: torch.device) -> Row:
    """Both refreshes of the debug model with `layers` blocks, measured, their outputs compared."""
    cfg = JobConfig()
    cfg.training.mixed_precision_param = "bfloat16"
    f8 = cfg.float8
    f8.enable, f8.emulate, f8.all_gather, f8.filter_fqns = True, True, True, ["output"]
    args = dataclasses.replace(llama3_configs["debugmodel"], n_layers=layers, vocab_size=2048)
    with fake_process_group(0, world):
        model = build_model(RunPlan.build(cfg, world, args=args), device)
        refresh = float8_gathers_of(model)
        assert refresh is not None
        gathers: Float8Gathers = refresh.__self__
        before = measure(lambda: per_weight(gathers), device)
        old = [(w.bits.clone(), w.scale.clone()) for w, _ in gathers.wires]
        after = measure(refresh, device)
        assert all(torch.equal(b, w.bits) and torch.equal(s, w.scale) for (b, s), (w, _) in zip(old, gathers.wires))
        return Row(layers, *_plan(gathers), before, after)


def planned(config: str, world: int) -> Row:
    """The float8 weights of `config` at `world` ranks, tp 1, built on the meta device (the dry run):
    their number, shard elements and the refresh's chunks; nothing runs."""
    from titanlite.config import load_config
    from titanlite.tools.dry_run import dry_run

    keys = ["--float8.enable", "--float8.all_gather", "--parallelism.tensor_parallel_degree", "1"]
    r = dry_run(load_config(["--config", config, *keys, "--comm.fake_world_size", str(world)]))
    refresh = float8_gathers_of(r.model)
    assert refresh is not None
    return Row(r.plan.model_args.n_layers, *_plan(refresh.__self__))


def _plan(gathers: Float8Gathers) -> tuple[int, int, int]:
    shards = [layer._parameters["weight"].to_local() for _, layer in gathers.wires]
    return len(shards), sum(s.numel() for s in shards), len(gathers._chunks(shards))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", default="8,32,128,512")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--plan", default="train_configs/llama3_70b.toml", help="a config to plan; '' for none")
    parser.add_argument("--plan-world", type=int, default=64)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: CUDA kernels and the allocator's peak")
    opts = parser.parse_args()
    device = torch.device(opts.device)
    ops = "kernels" if device.type == "cuda" else "ops"
    head = ["blocks", "float8 weights", "shards, fp32 MiB", f"{ops}, per weight", f"{ops}, refresh"]
    head += ["temporaries MiB, per weight", "temporaries MiB, refresh"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---:|" * len(head))
    mib = 2**20
    rows = []
    for layers in (int(n) for n in opts.layers.split(",")):
        r = measured(layers, opts.world, device)
        rows.append(r)
        cells = [r.blocks, r.weights, f"{4 * r.local / mib:.1f}", r.before[0], f"{r.after[0]} ({r.chunks} chunks)"]
        cells += [f"{r.before[1] / mib:.1f}", f"{r.after[1] / mib:.1f}"]
        print("| " + " | ".join(map(str, cells)) + " |", flush=True)
    a, b = rows[0], rows[-1]
    if opts.plan and a.chunks != b.chunks:
        # Ops grow by a fixed count per weight (the loop) and per chunk (the refresh): the first and last
        # rows give both, which the planned config's weights and chunks then price.
        per_weight = (b.before[0] - a.before[0]) / (b.weights - a.weights)
        per_chunk = (b.after[0] - a.after[0]) / (b.chunks - a.chunks)
        p = planned(opts.plan, opts.plan_world)
        ops_before = a.before[0] + per_weight * (p.weights - a.weights)
        ops_after = a.after[0] + per_chunk * (p.chunks - a.chunks)
        cells = [f"{p.blocks} ({opts.plan}, {opts.plan_world} ranks: planned)", p.weights, f"{4 * p.local / mib:.0f}"]
        cells += [f"~{ops_before:.0f}", f"~{ops_after:.0f} ({p.chunks} chunks)"]
        cells += [f">= {2 * p.local / mib:.0f} (the bf16 copies)", f"<= {CAST_CHUNK_BYTES / mib:.0f} (the bound)"]
        print("| " + " | ".join(map(str, cells)) + " |", flush=True)


if __name__ == "__main__":
    main()
