"""Dry run: will this config fit on its GPUs? Answered by one CPU process, without GPUs or weights.

    python -m titanlite.tools.dry_run --config FILE [--section.key value ...]
    ./run_train.sh --config FILE --dry-run          # or comm.mode = "fake_backend" in the config

The process joins torch's fake process group as rank `comm.fake_rank` of `comm.fake_world_size` ranks,
builds what each pipeline rank runs as the trainer does (`build.build_model`, on the meta device) and
reports the memory per GPU that `titanlite.planning.memory` estimates from the sharded parameters, the
step policy chosen from it (`build.choose_step_policy`) and the verdict. Nothing of model size is ever
allocated: 405B on 512 ranks plans in seconds. docs/dry_run.md describes the report.

Exit codes: 0 = fits, 1 = does not fit in the GPU's memory (one line with the numbers), 2 = bad config.
`compile_report` is the same idea for torch.compile: the compile report of one step on the fake group.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel
from torch.testing._internal.distributed.fake_pg import FakeStore

from titanlite.compile.report import REPORT_NAME
from titanlite.config import DEFAULT_CONFIG, JobConfig, load_config
from titanlite.errors import ConfigError, exit_now, run_tool
from titanlite.parallelisms.activation_checkpoint import OP_OPTIONS
from titanlite.parallelisms.data_parallel.reshard import ReshardPolicy
from titanlite.parallelisms.layout import Layout
from titanlite.parallelisms.parallelize import staging
from titanlite.parallelisms.units import Units
from titanlite.planning.assumed_vocabulary import build_run_plan
from titanlite.planning.memory import (
    COMFORT_FRACTION,
    GiB,
    MemoryEstimate,
    StepChoice,
    UnitGathers,
    held_copies,
)
from titanlite.planning.run_plan import RunPlan
from titanlite.run.build import build_model, choose_step_policy, rank_estimate
from titanlite.run.step import cross_entropy_loss


@dataclass
class DryRun:
    cfg: JobConfig
    plan: RunPlan
    world_size: int
    rank: int
    model: nn.Module
    """The parallelized model on the meta device (its process group is gone: read shapes only)."""
    layout: Layout
    memory: MemoryEstimate
    notes: list[str]
    pipeline_ranks: list[MemoryEstimate] = dataclasses.field(default_factory=list)
    """Under PP, the estimate of every pipeline rank (index = pipeline rank); empty without PP."""
    step_choice: StepChoice | None = None
    """The step policy, chosen as the trainer chooses it (`build.choose_step_policy`)."""
    units: tuple[Units, ...] = ()
    """The units of each part this rank runs (its model, or its pipeline stages in order)."""
    parts: tuple[nn.Module, ...] = ()
    """The parts themselves: its model, or its pipeline stages in order."""

    @property
    def capacity(self) -> int:
        return int(self.cfg.comm.fake_gpu_memory_gib * GiB)

    @property
    def peak(self) -> MemoryEstimate:
        """The estimate with the largest total over the ranks planned (every pipeline rank under PP)."""
        return max(self.pipeline_ranks or [self.memory], key=lambda e: e.total)

    @property
    def peak_total(self) -> int:
        return self.peak.total

    @property
    def fits(self) -> bool:
        return self.peak_total <= self.capacity


def world_size_of(cfg: JobConfig) -> int:
    return cfg.comm.fake_world_size or int(os.environ.get("WORLD_SIZE", "1"))


@contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """Be rank `rank` of `world_size` on torch's fake process group (collectives do nothing)."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def dry_run(cfg: JobConfig) -> DryRun:
    world_size, rank = world_size_of(cfg), cfg.comm.fake_rank
    if not 0 <= rank < world_size:
        raise ConfigError(f"comm.fake_rank {rank} is not a rank of a world of {world_size}")
    if cfg.comm.fake_gpu_memory_gib <= 0:
        raise ConfigError(f"config key 'comm.fake_gpu_memory_gib' must be positive, got {cfg.comm.fake_gpu_memory_gib}")
    plan, notes = build_run_plan(cfg, world_size)
    if not plan.dims.dp_enabled:
        notes.append("no data parallelism: mixed precision is applied by SimpleFSDP only, so compute is float32")
    if plan.spec.planning.activation_bytes is None:
        raise ConfigError(f"model {plan.spec.name!r} has no activation model: the dry run cannot plan it")
    # Every pipeline rank (one without PP) built on the meta device as one of its own ranks, with the same
    # dp/tp coordinates as `rank`; its parallelized modules, by pipeline rank.
    pp_rank, ranks = plan.dims.pp_rank_of(rank), {}
    for r, peer in enumerate(plan.dims.pipeline_peers(rank)):
        r_plan = plan if r == pp_rank else build_run_plan(cfg, world_size)[0]
        ranks[r] = build_rank(r_plan, peer, world_size)
    step_choice = choose_step_policy(plan, ranks, int(cfg.comm.fake_gpu_memory_gib * GiB))
    layout = plan.layout(step_choice.policy)
    estimates = {r: rank_estimate(plan, parts, layout, r) for r, parts in ranks.items()}
    parts = list(ranks[pp_rank].values())
    staged = staging(plan.cfg, plan.dims)
    model = staged.union(parts) if staged is not None else parts[0]
    if layout.ac_mode == "selective" and layout.ac_option in OP_OPTIONS:
        notes.append(selective_op_note(plan, layout))
    pipeline_ranks = list(estimates.values()) if plan.pipeline is not None else []
    units = tuple(plan.spec.units(part) for part in parts)
    memory = estimates[pp_rank]
    return DryRun(
        cfg, plan, world_size, rank, model, layout, memory, notes, pipeline_ranks, step_choice, units, tuple(parts)
    )


def build_rank(plan: RunPlan, rank: int, world_size: int) -> dict[int | None, nn.Module]:
    """What global `rank` runs, built on the meta device on a fake process group as the trainer builds it
    (`build.build_training`): its model ({None: model}) or its pipeline stages ({stage: module})."""
    with fake_process_group(rank, world_size):
        if plan.pipeline is None:
            return {None: build_model(plan, torch.device("meta"), mesh_device_type="cpu")}
        stages = plan.pipeline.stages_of(plan.dims.pp_rank_of(rank))
        return {s: build_model(plan, torch.device("meta"), mesh_device_type="cpu", stage=s) for s in stages}


def meta_model(plan: RunPlan) -> nn.Module:
    """The model of `plan` (no pipeline parallelism) as rank 0 of its world builds it on the meta device: the
    layout search reads its parameter shapes (`param_shapes.ShapeTable`)."""
    return build_rank(plan, 0, plan.dims.world_size)[None]


def selective_op_note(plan: RunPlan, layout: Layout) -> str:
    """Selective AC by op, both matmul rules (activation_checkpoint.py): the activation peak of each."""
    activation_bytes = plan.spec.planning.activation_bytes
    peaks = {
        option: activation_bytes(plan.model_args, dataclasses.replace(layout, ac_option=option))["peak"]
        for option in OP_OPTIONS
    }
    return (
        f"selective AC activations: {peaks['op'] / GiB:.2f} GiB with op (every other matmul saved), "
        f"{peaks['op_all_mm'] / GiB:.2f} GiB with op_all_mm (every matmul saved)"
    )


def compile_report(cfg: JobConfig, world_size: int, args: Any = None, seq_len: int = 16) -> dict[str, Any]:
    """The compile report of one training step of `cfg` (its degrees must multiply to `world_size`),
    computed in this process on torch's fake process group: the model (`args`, default the flavor's) is
    built as the trainer builds it, runs one forward and backward on random tokens, and the report it
    writes to `job.dump_folder` is returned. Collective values are meaningless; graphs and counts are real.
    """
    cfg = copy.deepcopy(cfg)
    cfg.training.seq_len = seq_len
    with fake_process_group(0, world_size):
        torch._dynamo.reset()
        plan = RunPlan.build(cfg, world_size, args=args)
        if not plan.compile_passes:
            raise ConfigError("a compile report needs compile.enable, backend aot_eager or inductor, and SimpleFSDP")
        model = build_model(plan, torch.device("cpu"))
        tokens = torch.randint(0, plan.model_args.vocab_size, (1, seq_len + 1))
        with loss_parallel() if plan.dims.loss_parallel else contextlib.nullcontext():
            cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        with open(os.path.join(cfg.job.dump_folder, REPORT_NAME)) as f:
            return json.load(f)


def _gib(n: float) -> str:
    return f"{n / GiB:8.2f}"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _dtype(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


Row = tuple[str, int, str]
"""A line of the memory table: label, bytes, detail."""


def format_report(r: DryRun) -> str:
    """The report: the run, the memory table of the rank of `comm.fake_rank`, every pipeline rank under PP,
    and the verdict line."""
    lines = [*header_lines(r), "", *memory_table(r)]
    if r.plan.pipeline is not None:
        lines += ["", *pipeline_table(r)]
    return "\n".join([*lines, verdict_line(r)])


def ac_text(lay: Layout) -> str:
    return lay.ac_mode + (f" ({lay.ac_option})" if lay.ac_mode == "selective" else "")


def header_lines(r: DryRun) -> list[str]:
    """The model, the world and its degrees, the precision, the batch, notes, the step policy and the
    pipeline schedule."""
    cfg, plan, lay, t = r.cfg, r.plan, r.layout, r.cfg.training
    dims = plan.dims
    degrees = dims.describe_degrees()
    dp = f"{cfg.parallelism.dp_impl} {lay.dp_mode}, reshard_after_forward {lay.reshard}" if lay.dp_mode else "no dp"
    compile_ = "eager"
    if cfg.compile.enable:
        scope = f", scope {scope_of(r)}" if "model" in cfg.compile.components else ""
        compile_ = f"compile {cfg.compile.backend}{scope} (wrapped, nothing compiled)"
    per_gpu = t.local_batch_size * dims.rank_tokens(t.seq_len) * plan.grad_accum
    lines = [
        f"dry run: {cfg.model.name} {cfg.model.flavor}, {_count(plan.model_args.num_params())} parameters, "
        f"vocab {plan.model_args.vocab_size:,}",
        f"  world {r.world_size}"
        + (f" (fake process group, rank {r.rank})" if r.world_size > 1 else "")
        + f": {degrees}; {dp}",
        f"  AC {ac_text(lay)}; {compile_}; compute {_dtype(lay.compute_dtype)}, reduce {_dtype(lay.reduce_dtype)}"
        + ("; loss parallel" if lay.loss_parallel else "")
        + float8_text(cfg),
        *gathers_lines(r),
        f"  batch: local {t.local_batch_size} x {dims.describe_sequence(t.seq_len)}"
        + f" x accum {plan.grad_accum} = {per_gpu:,} tokens/GPU/step; "
        f"global batch {plan.global_batch} = {plan.global_batch * t.seq_len:,} tokens/step",
        *(f"  note: {n}" for n in r.notes),
    ]
    if r.step_choice is not None and dims.dp_enabled and plan.backwards_per_step > 1:
        lines.append(f"  step of {plan.backwards_per_step} backwards: {r.step_choice.describe()}")
    if (sp := plan.pipeline) is not None:
        pp_rank = dims.pp_rank_of(r.rank)
        lines.append(
            f"  {sp.describe()}; microbatch {cfg.parallelism.pipeline_parallel_microbatch_size}, "
            f"{sp.in_flight(pp_rank)} in flight per stage on pipeline rank {pp_rank}"
        )
    return lines


def scope_of(r: DryRun) -> str:
    """The compile scope the model runs under (`compile.compile_scope`, `auto` resolved)."""
    from titanlite.compile.compiler import compile_scope

    return compile_scope(r.cfg, r.plan.dims)


def gathers_lines(r: DryRun) -> list[str]:
    """What the data-parallel all-gathers move (the unsharded side, as the compile report counts it), per
    forward, and under the eager prefetcher (compile scope `prefetch`) again before backward: the blocks
    resharded after forward, which it gathers again (`block_prefetch`); none without sharded weights."""
    lay, cfg = r.layout, r.cfg
    if lay.dp_mode in (None, "replicate"):
        return []
    sizes = [UnitGathers.of(part, units, lay).gathered(lay) for part, units in zip(r.parts, r.units)]
    forward = sum(sum(s.values()) for s in sizes)
    when = "per step (kept for the step)" if lay.keep_gathers else "per forward"
    again = ""
    if cfg.compile.enable and "model" in cfg.compile.components and scope_of(r) == "prefetch":
        plan = ReshardPolicy.of(lay.reshard, sum(len(u.blocks) for u in r.units))
        freed = [b for units in r.units for b in units.blocks]
        regathered = sum(s.get(b, 0) for s in sizes for b, f in zip(freed, plan.blocks) if f)
        again = f", {regathered / GiB:.2f} GiB again before backward (the prefetcher's re-gathers)"
    dtype = _dtype(lay.compute_dtype)
    what = f"float8 layers' weights as float8 (1 byte per element), the rest {dtype}" if lay.float8_gather else dtype
    return [f"  all-gathered: {forward / GiB:.2f} GiB {when}{again}; {what}"]


def float8_text(cfg: JobConfig) -> str:
    """The header's float8 settings, empty without float8."""
    f8 = cfg.float8
    if not f8.enable:
        return ""
    return f"; float8 {f8.recipe}" + " (emulated)" * f8.emulate + ", weights gathered in float8" * f8.all_gather


def memory_table(r: DryRun) -> list[str]:
    """Memory per GPU of the rank of `comm.fake_rank`, part by part, and its total."""
    m, lay = r.memory, r.layout
    rows: list[Row] = [
        ("parameters", m.params, f"fp32, {sum(m.local_numel.values()):,} local elements"),
        ("gradients", m.grads, "fp32"),
        ("optimizer state", m.optimizer, "AdamW exp_avg + exp_avg_sq, fp32"),
        *(collective_rows(r) if lay.dp_mode else []),
    ]
    if m.receive_buffers:
        rows.append(
            (
                "pipeline receive buffers",
                m.receive_buffers,
                "torch's stages: activations and gradients, every microbatch",
            )
        )
    rows.append(("activations", m.activations, f"AC {ac_text(lay)}, eager kernels, the peak of:"))
    rows += [("  " + name, v, "") for name, v in m.activation_parts.items()]
    who = f" (pipeline rank {r.plan.dims.pp_rank_of(r.rank)})" if r.plan.pipeline is not None else ""
    share = m.total / r.capacity
    return [
        f"  {'memory per GPU' + who:<34}{'GiB':>8}",
        *(f"  {label:<34}{_gib(v)}  {detail}".rstrip() for label, v, detail in rows),
        f"  {'total':<34}{_gib(m.total)}  of {r.cfg.comm.fake_gpu_memory_gib:g} GiB ({share:.0%})",
    ]


def collective_rows(r: DryRun) -> list[Row]:
    """Data parallelism's buffers: gathered weights held or kept, gathers in flight, the gradients before
    their reduction and its packing, SimpleFSDP's float8 shards."""
    m, lay = r.memory, r.layout
    sink_dtype = lay.reduce_dtype if lay.dp_impl == "fsdp2" else torch.float32
    if lay.keep_gathers:
        in_flight = "none: all kept"
    else:
        in_flight = "two units (FSDP2 prefetch)" if lay.dp_impl == "fsdp2" else "largest unit (a block or the output)"
    rows: list[Row] = [
        (
            "gathered weights kept for the step" if lay.keep_gathers else "gathered weights held fwd->bwd",
            m.gather_held,
            f"{held_text(r)}, {'float8 layers in float8, the rest ' * lay.float8_gather}{_dtype(lay.compute_dtype)}",
        ),
        ("gathers in flight", m.gather_in_flight, in_flight),
        (
            "unreduced gradients" if lay.unreduced_grads else "reduce-scatter input",
            m.reduce_buffer,
            f"all, reduced once per step, {_dtype(sink_dtype)}"
            if lay.unreduced_grads
            else f"largest unit, {_dtype(lay.reduce_dtype)}",
        ),
    ]
    if m.float8_shards:
        rows.append(("float8 weight shards", m.float8_shards, "SimpleFSDP's float8 copy of each float8 weight's shard"))
    if m.reduce_transient:
        packing = "largest unit" if lay.dp_impl == "fsdp2" else "one bucket (or the largest gradient) + its shard"
        rows.append(("reduction packing", m.reduce_transient, packing))
    return rows


def held_text(r: DryRun) -> str:
    """The gather units the memory estimate holds (`MemoryEstimate.held_units`), in words: blocks, then root
    modules by name (FSDP2's root group as one); under PP, the copies held per microbatch in flight."""
    lay, plan, held = r.layout, r.plan, r.memory.held_units
    blocks = [b for units in r.units for b in units.blocks]
    last_blocks = [list(units.blocks)[-1] for units in r.units if units.blocks]
    held_blocks = [b for b in blocks if b in held]
    roots = [root for units in r.units for root in units.roots]
    held_roots = [root for root in roots if any(u == root or u.startswith(root + ".") for u in held)]
    if lay.dp_impl == "fsdp2" and "root" in held:
        held_roots = ["root group"]
    if not held:
        return "none"
    if held_blocks == blocks and (held_roots == roots or held_roots == ["root group"]):
        text = "all"
    else:
        if held_blocks == blocks:
            which = ["every block"]
        elif held_blocks == last_blocks:
            which = ["each stage's last block" if len(r.units) > 1 else "last block"]
        else:
            which = [f"{len(held_blocks)} blocks"] if held_blocks else []
        text = " + ".join(which + held_roots)
    if plan.pipeline is not None and lay.dp_impl == "fsdp2" and not lay.keep_gathers:
        text += " from their first backward (torch's pipeline stage)"
    elif plan.pipeline is not None:
        in_flight = plan.pipeline.in_flight(plan.dims.pp_rank_of(r.rank))
        if (copies := held_copies(lay, in_flight)) > 1:
            text += f", a copy per microbatch in flight ({copies})"
    return text


def pipeline_table(r: DryRun) -> list[str]:
    """Every pipeline rank: its stages, blocks, model state, buffers, activations and total."""
    sp = r.plan.pipeline
    assert sp is not None
    header = (
        f"{'pipeline rank':<15}{'stages':<12}{'blocks':>7}{'model state':>13}{'buffers':>9}{'activations':>13}"
        f"{'total':>9}"
    )
    lines = ["  " + header]
    for i, pm in enumerate(r.pipeline_ranks):
        stages = sp.stages_of(i)
        blocks = sum(len(sp.blocks(s)) for s in stages)
        state = pm.params + pm.grads + pm.optimizer
        lines.append(
            f"  {i:<15}{','.join(map(str, stages)):<12}{blocks:>7}{_gib(state):>13}"
            f"{_gib(pm.collective_buffers):>9}{_gib(pm.activations):>13}{_gib(pm.total):>9}"
        )
    return lines


def verdict_line(r: DryRun) -> str:
    """Fits, fits tight (above `COMFORT_FRACTION`), or does not fit, for the rank that needs most."""
    peak, gpu = r.peak, f"{r.cfg.comm.fake_gpu_memory_gib:g} GiB"
    where = f" on pipeline rank {r.pipeline_ranks.index(peak)}" if r.pipeline_ranks else ""
    share = peak.total / r.capacity
    if not r.fits:
        return (
            f"does not fit: {peak.total / GiB:.1f} GiB per GPU{where} > {gpu} "
            f"(params {peak.params / GiB:.1f} + grads {peak.grads / GiB:.1f} + optimizer {peak.optimizer / GiB:.1f} "
            f"+ buffers {peak.collective_buffers / GiB:.1f} + activations {peak.activations / GiB:.1f})"
        )
    if share > COMFORT_FRACTION:
        return (
            f"fits, tight: {peak.total / GiB:.1f} of {gpu} per GPU{where} "
            f"({share:.0%}); the CUDA context, NCCL buffers and fragmentation need some of the rest"
        )
    return f"fits: {peak.total / GiB:.1f} of {gpu} per GPU{where} ({share:.0%})"


def main(argv: list[str]) -> int:
    result = dry_run(load_config(argv, default_config=DEFAULT_CONFIG))
    print(format_report(result), flush=True)
    return 0 if result.fits else 1


if __name__ == "__main__":
    exit_now(run_tool(main))
