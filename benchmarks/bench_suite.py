"""Data-parallel variants side by side: throughput, peak memory, collectives per step and MFU, one launch.

    python benchmarks/bench_suite.py [--rounds 3] [--steps 4] [--warmup 3] [--nproc 2] [--accum 1]
        [--only FRAGMENT,...|=NAME] [--out outputs/bench/suite.json] [--config FILE] [--section.key value ...]

Starts itself under torchrun (2 ranks: gloo on CPU, NCCL on GPUs) and builds every variant in that one
launch, each built by the trainer itself (`Trainer(cfg)`: `titanlite.run.build`, the model's parallelize
plan) and stepped with the shipped `Trainer.train_step` on fixed random tokens:

    SimpleFSDP eager / compiled / compiled + per-block bucketing (one graph, `compile.scope` auto, and
    per-block graphs, scope block), FSDP2 eager / compiled, replicate (SimpleFSDP's DDP mode), tp=2 (the
    dp x tp variant at 2 ranks: dp is 1), pp=2 (two pipeline stages, 1F1B over microbatches of
    `parallelism.pipeline_parallel_microbatch_size`; dp is 1), and under full activation checkpointing
    SimpleFSDP compiled + bucketing (one graph, per-block graphs, and per-block graphs with the eager
    prefetcher: scope prefetch, what auto compiles there) against FSDP2 eager; SimpleFSDP eager
    and compiled with `model.attn_mask_type = block_causal` (packed documents of about a quarter of the
    sequence each, `packed_positions`) against the same variants causal; with
    `--nproc 4` or more also pp=2 x dp over 4 microbatches, weights kept for the step or gathered
    again per microbatch, SimpleFSDP and FSDP2 (`PP_VARIANTS`). Context parallelism (`cp_variants`): cp=2
    on the same global batch as the dp variants (each rank holds half of twice as many sequences: the
    same tokens per rank), and cp=2 on half of it (the dp variants' local batch split across the two
    ranks: half the tokens per rank, the memory comparison of one sequence held by one rank or by two).
    Mixture of experts (`MOE_VARIANTS`): the qwen3_moe debug model with its experts data-parallel (ep=1)
    and sharded over the two ranks (ep=2, tokens dispatched by all-to-all), compared with ep=1; each with
    the experts as grouped GEMMs (the default) and as a loop (`model.moe_experts = "loop"`).
    Float8 (`FLOAT8_VARIANTS`, docs/float8.md): SimpleFSDP compiled + bucketing with float8 tensorwise
    and its weights gathered in float8, the same rowwise, and FSDP2 eager tensorwise with torchao's float8
    gathers, each against its twin without float8; emulated on a CPU (slower there: the row shows the
    gathered bytes, not what float8 gains on a GPU).

Every variant processes the same global batch (local batch x 2 x `--accum` sequences per step: with
`--accum` > 1 the dp variants accumulate that many microbatches, and variants reducing gradients in
every microbatch's backward run beside those reducing once per step, the default; the tp variant's
single dp rank takes all of it in the trainer's microbatches: two local batches, accumulated; so does
the pp variant's). Rank 0's figures: under pp that is the first stage (embedding and the first blocks). After
`--warmup` steps per variant (compilation happens there), the variants run `--steps` steps each in
`--rounds` interleaved rounds, so drift in machine load hits all of them alike; tokens/s is the global
batch over the median step time.

Peak memory is the variant's model state (parameters, gradients and optimizer state, from the local
tensors) plus the highest step-time growth over the memory in use before its steps: on CUDA
`max_memory_allocated`, on CPU the resident set (VmHWM after a reset through /proc/self/clear_refs, with
glibc's heap trimmed first and large blocks mmapped, so freed memory is returned and not reused
unseen). All variants live in one process, hence the growth rather than the absolute peak.

Collectives per step are counted in one extra profiled step per variant, from the process-group ops the
profiler records (`c10d::*`: every all-gather, reduce-scatter and all-reduce that reaches the backend,
eager or compiled, FSDP2 included; the all-reduces include the gradient norm's and the trainer's
agreement on a finite step), on rank 0; with them the bytes its all-gathers deliver (their outputs'
recorded shapes and dtypes, `gathered_bytes`). MFU uses `ModelArgs.flops_per_token` against
`titanlite.metrics.peak_tflops` (GPU table, or a measured CPU matmul peak).

Ratios are against FSDP2 eager with the same activation checkpointing (a float8 or block_causal
variant: its twin). Rank 0 prints a markdown table
and writes the JSON; the trainers' dump folder (compile reports, their
lock) is `suite_runs/` next to it. A variant that cannot be built or run here (e.g.
bucketing before the compile passes exist) is reported as failed with its one-line reason.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import inspect
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titanlite.config import CHOICES, DEFAULT_CONFIG, load_config  # noqa: E402
from titanlite.data.batch import Batch  # noqa: E402
from titanlite.metrics import mfu_pct, peak_tflops  # noqa: E402
from titanlite.planning.memory import local_tensor  # noqa: E402
from titanlite.run.build import init_device, init_distributed  # noqa: E402
from titanlite.run.trainer import Trainer  # noqa: E402

COMPILE = ["--compile.enable", "--compile.backend", "inductor"]
BUCKETED = [*COMPILE, "--compile.bucketing", "transformer_block"]
PER_BLOCK = ["--compile.scope", "block"]
FULL_AC = ["--activation_checkpoint.mode", "full"]
BLOCK_CAUSAL = ["--model.attn_mask_type", "block_causal"]
MASKED = ", block_causal"
VARIANTS: dict[str, list[str]] = {
    "SimpleFSDP eager": [],
    "SimpleFSDP compiled": COMPILE,
    "SimpleFSDP compiled + bucketing": BUCKETED,
    "SimpleFSDP compiled + bucketing, per-block graphs": [*BUCKETED, *PER_BLOCK],
    "FSDP2 eager": ["--parallelism.dp_impl", "fsdp2"],
    "FSDP2 compiled": ["--parallelism.dp_impl", "fsdp2", *COMPILE],
    "replicate (DDP)": [
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
    ],
    "tp=2 (dp x tp)": ["--parallelism.tensor_parallel_degree", "2"],
    "pp=2 (1F1B)": ["--parallelism.pipeline_parallel_degree", "2"],
    # Full activation checkpointing (the 70B/405B configs), against FSDP2 eager with the same checkpointing.
    "SimpleFSDP compiled + bucketing, full AC": [*BUCKETED, *FULL_AC, "--compile.scope", "model"],
    "SimpleFSDP compiled + bucketing, full AC, per-block graphs": [*BUCKETED, *FULL_AC, *PER_BLOCK],
    "SimpleFSDP compiled + bucketing, full AC, prefetch (auto)": [*BUCKETED, *FULL_AC],
    "FSDP2 eager, full AC": ["--parallelism.dp_impl", "fsdp2", *FULL_AC],
    # Document masks over the batch's packed documents, against the same variant with causal attention.
    "SimpleFSDP eager, block_causal": BLOCK_CAUSAL,
    "SimpleFSDP compiled, block_causal": [*COMPILE, *BLOCK_CAUSAL],
}
PER_MICROBATCH = ["--parallelism.gradient_reduction", "per_microbatch"]
ACCUM_VARIANTS: dict[str, list[str]] = {
    "SimpleFSDP eager, reduce per microbatch": PER_MICROBATCH,
    "SimpleFSDP compiled + bucketing, reduce per microbatch": [
        *COMPILE,
        "--compile.bucketing",
        "transformer_block",
        *PER_MICROBATCH,
    ],
    "FSDP2 eager, reduce per microbatch": ["--parallelism.dp_impl", "fsdp2", *PER_MICROBATCH],
}
"""With `--accum` > 1: the data-parallel variants reducing in every microbatch's backward, beside the
default (`gradient_reduction = auto`: once per step)."""
PP_MICROBATCHES = 4
REGATHER = ["--parallelism.fsdp_reshard_after_forward", "default"]
PP_VARIANTS: dict[str, list[str]] = {
    "pp=2 x dp, 4 microbatches, SimpleFSDP, kept for the step": [],
    "pp=2 x dp, 4 microbatches, SimpleFSDP, gathered per microbatch": REGATHER,
    "pp=2 x dp, 4 microbatches, FSDP2, kept for the step": ["--parallelism.dp_impl", "fsdp2"],
    "pp=2 x dp, 4 microbatches, FSDP2, gathered per microbatch": ["--parallelism.dp_impl", "fsdp2", *REGATHER],
}
"""With 4 or more ranks: 2 pipeline stages x data parallelism, the global batch in one schedule step of 4
microbatches, the weights kept for the step (`fsdp_reshard_after_forward = auto`, which keeps them when
the memory estimate fits) beside gathered again in every microbatch (`default`, the per-block policy)."""
BASELINE = "FSDP2 eager"
FULL_AC_BASELINE = "FSDP2 eager, full AC"
FLOAT8 = ", float8 "
"""What a float8 variant's name adds to its twin's: `<twin>, float8 <recipe>[ + float8 all-gather]`."""
FLOAT8_CONVERT = ["--float8.enable", "--float8.filter_fqns", "output"]
TENSORWISE_GATHER = [*FLOAT8_CONVERT, "--float8.recipe", "tensorwise", "--float8.all_gather"]
FLOAT8_VARIANTS: dict[str, list[str]] = {
    "SimpleFSDP compiled + bucketing, float8 tensorwise + float8 all-gather": [*BUCKETED, *TENSORWISE_GATHER],
    "SimpleFSDP compiled + bucketing, float8 rowwise": [*BUCKETED, *FLOAT8_CONVERT, "--float8.recipe", "rowwise"],
    "FSDP2 eager, float8 tensorwise + float8 all-gather": ["--parallelism.dp_impl", "fsdp2", *TENSORWISE_GATHER],
}
"""Float8 linear layers (docs/float8.md) beside their twins without float8: every linear layer but the
output projection (named: the debug model's layers are below the automatic filter's sizes)."""


def float8_variants(device: torch.device) -> dict[str, list[str]]:
    """`FLOAT8_VARIANTS`, emulated on a CPU (the casts and scales real, the matmuls in the training dtype:
    slower than without float8, the gathered bytes as on a GPU); real float8 matmuls elsewhere."""
    emulate = ["--float8.emulate"] if device.type == "cpu" else []
    return {name: [*extra, *emulate] for name, extra in FLOAT8_VARIANTS.items()}


def baseline_of(name: str) -> str:
    """The row a variant is compared with: FSDP2 eager under the same activation checkpointing; a
    block_causal variant, the same variant causal; a float8 variant, the same variant without float8."""
    if name.endswith(MASKED):
        return name.removesuffix(MASKED)
    if FLOAT8 in name:
        return name.split(FLOAT8)[0]
    if name.startswith("MoE"):
        return MOE_BASELINE
    return FULL_AC_BASELINE if "full AC" in name else BASELINE


KINDS = (("allgather", "ag"), ("reduce_scatter", "rs"), ("allreduce", "ar"), ("alltoall", "a2a"))


@dataclass
class Result:
    name: str
    overrides: list[str]
    error: str = ""
    step_times: list[float] = field(default_factory=list)
    peak_delta: int = 0
    state_bytes: int = 0
    collectives: dict[str, int] = field(default_factory=dict)
    tokens_per_step: int = 0
    flops_per_token: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / statistics.median(self.step_times) if self.step_times else 0.0

    @property
    def peak_bytes(self) -> int:
        return self.state_bytes + self.peak_delta


def packed_positions(rows: int, seq_len: int, g: torch.Generator) -> torch.Tensor:
    """Positions of packed documents of seq_len / 8 to 3 seq_len / 8 tokens (about four per row), a row
    starting inside one; only block_causal variants read them."""
    out = []
    for _ in range(rows):
        row = list(range(int(torch.randint(1, seq_len // 4, (), generator=g)), seq_len // 4))
        while len(row) < seq_len:
            row += range(int(torch.randint(seq_len // 8, 3 * seq_len // 8 + 1, (), generator=g)))
        out.append(row[:seq_len])
    return torch.tensor(out)


class Variant:
    """One run, built by the trainer itself, with its fixed batch."""

    def __init__(self, cfg, device: torch.device):
        self.trainer = Trainer(cfg)
        plan = self.trainer.plan
        self.model, self.optimizer = self.trainer.model, self.trainer.optimizer
        dp_rank = plan.dims.dp_rank_of(dist.get_rank())
        g = torch.Generator().manual_seed(1000 + dp_rank)
        shape = (plan.global_batch // plan.dims.dp, cfg.training.seq_len + 1)
        tokens = torch.randint(0, plan.model_args.vocab_size, shape, generator=g).to(device)
        # The rank's share of the global batch in the trainer's microbatches (local batch x grad_accum).
        positions = packed_positions(shape[0], cfg.training.seq_len, g).to(device)
        self.batches = [
            Batch(m[:, :-1], m[:, 1:], p)
            for m, p in zip(tokens.split(cfg.training.local_batch_size), positions.split(cfg.training.local_batch_size))
        ]
        assert len(self.batches) == plan.grad_accum
        self.flops_per_token = plan.model_args.flops_per_token(cfg.training.seq_len)
        self.compute_bytes = plan.param_dtype.itemsize

    def step(self) -> None:
        self.trainer.step += 1
        loss, _ = self.trainer.train_step(self.batches)
        loss.item()  # waits for the device

    def state_bytes(self) -> int:
        tensors = [local_tensor(p) for p in self.model.parameters()]
        tensors += [local_tensor(p.grad) for p in self.model.parameters() if p.grad is not None]
        tensors += [local_tensor(v) for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        return sum(t.nbytes for t in tensors)


class MemoryProbe:
    """Growth of memory in use over its level at `start()`: CUDA allocator, or the CPU resident set."""

    def __init__(self, device: torch.device):
        self.device = device
        libc = ctypes.CDLL("libc.so.6") if sys.platform.startswith("linux") else None
        self.trim = getattr(libc, "malloc_trim", None)
        self.base = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return
        if self.trim is not None:
            self.trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.base = self._status("VmRSS")

    def growth(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.base
        return self._status("VmHWM") - self.base

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"{key} not in /proc/self/status")


PROFILER_DTYPE_BYTES = {
    "double": 8,
    "long int": 8,
    "float": 4,
    "int": 4,
    "c10::BFloat16": 2,
    "c10::Half": 2,
    "short int": 2,
    "unsigned char": 1,
    "signed char": 1,
    "bool": 1,
    "c10::Float8_e4m3fn": 1,
    "c10::Float8_e5m2": 1,
}
"""Bytes per element of the dtypes as the profiler names them (`FunctionEvent.input_dtypes`)."""


def gathered_bytes(event, world: int) -> int:
    """The bytes an all-gather event delivers to the rank (its output, every rank's shard), from the shapes
    and dtypes the profiler recorded. The c10d op's first argument is its output (a tensor, or a list of
    them when coalesced; the list form `allgather_` records none: its input times `world`); a list's
    dtype is not recorded, so it is read from the functional op that issued it (the parent) or the
    backend's own event (a child), whichever names one."""
    shapes = event.structured_input_shapes
    if shapes[0]:
        outputs = shapes[0] if isinstance(shapes[0][0], list) else [shapes[0]]
        elements = sum(math.prod(s) for s in outputs)
    else:
        elements = world * sum(math.prod(s) for s in shapes[1])
    for source in (event, event.cpu_parent, *event.cpu_children):
        if source is not None and source.input_dtypes and source.input_dtypes[0] in PROFILER_DTYPE_BYTES:
            return elements * PROFILER_DTYPE_BYTES[source.input_dtypes[0]]
    raise ValueError(f"no dtype recorded for {event.name} (parent {getattr(event.cpu_parent, 'name', None)})")


def count_collectives(variant: Variant, world: int) -> dict[str, int]:
    """Process-group ops per kind in one profiled step; `ag_bytes`: the bytes the rank's all-gathers
    deliver (`gathered_bytes`; absent where the profiler records no dtypes); `a2a_bytes`: the elements
    the rank's all-to-alls send (their inputs, from the functional ops' recorded shapes) times the size
    of the compute dtype, the dtype of the tokens an expert-parallel layer dispatches."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        variant.step()
    counts: collections.Counter[str] = collections.Counter()
    sized = "input_dtypes" in inspect.signature(FunctionEvent).parameters  # recorded from torch 2.13 on
    if sized:
        counts["ag_bytes"] = 0
    for event in prof.events():
        if event.name.startswith("c10d::"):
            kind = next((short for key, short in KINDS if key in event.name), "other")
            counts[kind] += 1
            if kind == "ag" and sized:
                counts["ag_bytes"] += gathered_bytes(event, world)
        elif event.name.endswith("all_to_all_single") and event.input_shapes and event.input_shapes[0]:
            counts["a2a_bytes"] += math.prod(event.input_shapes[0]) * variant.compute_bytes
    return dict(counts)


def bucketing_available() -> bool:
    return "transformer_block" in CHOICES.get("compile.bucketing", ())


def selects(key: str, name: str) -> bool:
    """`--only` fragment `key` picks variant `name`: a case-insensitive substring, or `=NAME` exactly."""
    return key[1:].lower() == name.lower() if key.startswith("=") else key.lower() in name.lower()


def worker(args: argparse.Namespace, overrides: list[str]) -> None:
    # Collectives keep the start-up timeout (10 min here: compiling a variant can take minutes) because the
    # variants are stepped without `Trainer.train`, which is what shortens it after step 1.
    # The trainers write (compile reports, metrics file) and hold the dump folder's lock: a folder of the
    # benchmark's own, not the config's, so a training run of that config can go on meanwhile.
    dump = str(Path(args.out).parent / "suite_runs")
    base = ["--config", args.config, "--job.dump_folder", dump, "--no-metrics.enable_tensorboard"]
    base += ["--comm.init_timeout_seconds", "600", *overrides]
    base_cfg = load_config(base)
    device = init_device()  # the trainer's device and process group (`titanlite.run.build`), shared by the variants
    init_distributed(base_cfg, device)
    rank, world = dist.get_rank(), dist.get_world_size()
    # Several models in one process: each block of each compiled variant is its own Dynamo cache entry.
    torch._dynamo.config.recompile_limit = torch._dynamo.config.accumulated_recompile_limit = 4096
    global_batch = base_cfg.training.local_batch_size * world * args.accum
    results: dict[str, Result] = {}
    variants: dict[str, Variant] = {}
    for name, extra in (
        VARIANTS
        | (ACCUM_VARIANTS if args.accum > 1 else {})
        | pp_variants(global_batch, world)
        | cp_variants(base_cfg.training.local_batch_size)
        | MOE_VARIANTS
        | float8_variants(device)
    ).items():
        if args.only and not any(selects(key, name) for key in args.only.split(",")):
            continue
        result = results[name] = Result(name, extra)
        if "--compile.bucketing" in extra and not bucketing_available():
            result.error = "compile.bucketing=transformer_block is not an option of this config schema"
            continue
        try:
            batch = str(global_batch // 2 if name.startswith(CP_HALF) else global_batch)
            cfg = load_config([*base, *extra, "--training.global_batch_size", batch])
            variant = Variant(cfg, device)
            for _ in range(args.warmup):
                variant.step()
            result.collectives = count_collectives(variant, world)
        except Exception as e:  # a variant this torch/machine cannot run: report it, bench the rest
            result.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
            continue
        result.tokens_per_step = cfg.training.global_batch_size * cfg.training.seq_len
        result.flops_per_token = variant.flops_per_token
        variants[name] = variant
        if rank == 0:
            print(f"bench_suite: {name} ready", flush=True)
    probe = MemoryProbe(device)
    for _ in range(args.rounds):
        for name, variant in variants.items():
            dist.barrier()
            probe.start()
            for _ in range(args.steps):
                start = time.perf_counter()
                variant.step()
                results[name].step_times.append(time.perf_counter() - start)
            results[name].peak_delta = max(results[name].peak_delta, probe.growth())
            results[name].state_bytes = variant.state_bytes()
    peak, peak_source = peak_tflops(device)
    if rank == 0:
        rows = [result_row(r, world, peak) for r in results.values()]
        record = dict(
            world=world,
            device=str(device),
            peak_tflops=peak,
            peak_source=peak_source,
            args=vars(args),
            overrides=overrides,
            variants=rows,
        )
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=2))
        print(format_table(rows, world, device, peak_source, args), flush=True)
        print(f"\nJSON: {args.out}", flush=True)
    for variant in variants.values():
        variant.trainer.close()
    dist.destroy_process_group()


def pp_variants(global_batch: int, world: int) -> dict[str, list[str]]:
    """`PP_VARIANTS` with the local batch and microbatch size that put a data-parallel rank's share of the
    global batch in one schedule step of `PP_MICROBATCHES` microbatches; none below 4 ranks (pp 2 would
    leave no data parallelism, hence nothing to gather)."""
    if world < 4:
        return {}
    local = global_batch // (world // 2)
    batch = ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", str(local)]
    batch += ["--parallelism.pipeline_parallel_microbatch_size", str(local // PP_MICROBATCHES)]
    return {name: [*batch, *extra] for name, extra in PP_VARIANTS.items()}


CP_HALF = "cp=2, half the global batch"


MOE = ["--model.name", "qwen3_moe", "--model.flavor", "debugmodel"]
MOE_BASELINE = "MoE (qwen3_moe debugmodel), ep=1"
MOE_VARIANTS: dict[str, list[str]] = {
    MOE_BASELINE: MOE,
    "MoE (qwen3_moe debugmodel), ep=2": [*MOE, "--parallelism.expert_parallel_degree", "2"],
    "MoE (qwen3_moe debugmodel), ep=1, experts as a loop": [*MOE, "--model.moe_experts", "loop"],
    "MoE (qwen3_moe debugmodel), ep=2, experts as a loop": [
        *MOE,
        "--parallelism.expert_parallel_degree",
        "2",
        "--model.moe_experts",
        "loop",
    ],
}


def cp_variants(local: int) -> dict[str, list[str]]:
    """cp=2 (dp the rest) on the dp variants' global batch (twice their local batch per dp rank: the same
    tokens per rank) and on half of it (their local batch: half the tokens per rank)."""
    cp = ["--parallelism.context_parallel_degree", "2"]
    return {
        "cp=2, same global batch": [*cp, "--training.local_batch_size", str(2 * local)],
        CP_HALF: [*cp, "--training.local_batch_size", str(local)],
    }


def result_row(r: Result, world: int, peak: float | None) -> dict:
    tps = r.tokens_per_s
    return dict(
        name=r.name,
        overrides=r.overrides,
        error=r.error,
        tokens_per_s=tps,
        step_times_s=r.step_times,
        peak_mib=r.peak_bytes / 2**20,
        state_mib=r.state_bytes / 2**20,
        step_growth_mib=r.peak_delta / 2**20,
        collectives=r.collectives,
        collectives_per_step=sum(n for kind, n in r.collectives.items() if not kind.endswith("_bytes")),
        all_gathered_mib=r.collectives["ag_bytes"] / 2**20 if "ag_bytes" in r.collectives else None,
        mfu_pct=mfu_pct(r.flops_per_token * tps / (world * 1e12), peak) if tps else 0.0,
    )


def format_table(rows: list[dict], world: int, device: torch.device, peak_source: str, args) -> str:
    ok = {r["name"]: r for r in rows if not r["error"]}
    lines = [
        f"{world} ranks on {device.type}, {args.rounds} rounds x {args.steps} steps after {args.warmup} warm-up; "
        f"tokens/s of the global batch at the median step; MFU against {peak_source}; ratios against "
        f"{BASELINE} (full AC rows: {FULL_AC_BASELINE}; block_causal rows: the same variant, causal; MoE rows: ep=1; "
        "float8 rows: the same variant without float8"
        + ("; float8 emulated on a CPU: slower, the gathered bytes as on a GPU" if device.type == "cpu" else "")
        + ")",
        "",
        "| variant | tokens/s | x baseline | peak MiB | x baseline | collectives/step (ag/rs/ar/a2a) "
        "| all-gathered MiB/step | a2a KiB/step | MFU % |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        if r["error"]:
            lines.append(f"| {r['name']} | failed: {r['error']} | | | | | | | |")
            continue
        base = ok.get(baseline_of(r["name"]))
        c = r["collectives"]
        tps_ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "n/a"
        mem_ratio = f"{r['peak_mib'] / base['peak_mib']:.2f}" if base else "n/a"
        gathered = "n/a" if r["all_gathered_mib"] is None else f"{r['all_gathered_mib']:,.2f}"
        mfu = "n/a" if r["mfu_pct"] is None else f"{r['mfu_pct']:.1f}"
        lines.append(
            f"| {r['name']} | {r['tokens_per_s']:,.0f} | {tps_ratio} | {r['peak_mib']:,.0f} | {mem_ratio} | "
            f"{r['collectives_per_step']} ({c.get('ag', 0)}/{c.get('rs', 0)}/{c.get('ar', 0)}/{c.get('a2a', 0)}) | "
            f"{gathered} | {c.get('a2a_bytes', 0) / 1024:,.0f} | {mfu} |"
        )
    return "\n".join(lines)


def rounds_parser(doc: str, what: str, steps: int, warmup: int) -> argparse.ArgumentParser:
    """The options every interleaved benchmark takes: rounds, and timed and untimed steps per `what`."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=steps, help=f"timed steps per {what} and round")
    parser.add_argument("--warmup", type=int, default=warmup, help=f"untimed steps per {what}")
    return parser


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = rounds_parser(__doc__, "variant (the first ones compile)", steps=4, warmup=3)
    parser.add_argument("--nproc", type=int, default=2, help="ranks of the launch (the variants assume 2)")
    parser.add_argument(
        "--accum", type=int, default=1, help="gradient accumulation: microbatches of the local batch per step"
    )
    parser.add_argument("--only", default="", help="comma-separated name fragments of the variants to run")
    parser.add_argument("--out", default="outputs/bench/suite.json")
    parser.add_argument("--config", default=str(ROOT / DEFAULT_CONFIG))
    return parser.parse_known_args(argv)


def without_nproc(argv: list[str]) -> list[str]:
    """`argv` without `--nproc N` / `--nproc=N` (the launcher's setting, not the workers')."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def main(argv: list[str]) -> int:
    args, overrides = parse(argv)
    if "LOCAL_RANK" in os.environ:
        worker(args, overrides)
        return 0
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))  # large CPU tensors: mmap, returned when freed
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc}",
        "--local-ranks-filter",
        "0",
        __file__,
        *without_nproc(argv),  # torchrun's parser would take `--nproc` for its own (ambiguous) option
    ]
    return subprocess.run(cmd, env=env, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
