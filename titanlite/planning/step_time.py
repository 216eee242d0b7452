"""How long one optimizer step takes on a GPU kind, for a layout: compute, recomputation, exposed
communication, the pipeline bubble and the optimizer, from the model's cost per token (`models/cost.py`),
the layout's gather units (`layout_memory.py`) and the GPU's figures (`gpus.py`).

Compute per microbatch and pipeline rank: matmuls and attention at the GPU's achievable rates times its
calibrated training efficiency, elementwise bytes over HBM; backward 2 x the matmuls and elementwise,
2.5 x the attention; recomputation as the AC mode repeats the forward. Collectives are ring traffic plus a
fixed latency (`link.Link`) over NVLink or the network: tensor and context parallelism's are their units'
terms (`ParallelismUnit.step_time`), data parallelism's `data_parallel_time.py`'s, the pipeline's
send/recv here. A schedule step lasts m T / (1 - bubble) (`StageLayout.bubble_fraction`), plus its
accumulation batches, the once-per-step reductions and AdamW (32 bytes per fp32 parameter).
docs/layout_search.md gives each term and its sources.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from titanlite.config import ActivationCheckpoint
from titanlite.models.cost import ModelCost
from titanlite.parallelisms.activation_checkpoint import block_ac
from titanlite.parallelisms.layout import Layout
from titanlite.parallelisms.parallelism import StageWork
from titanlite.parallelisms.parallelize import enabled
from titanlite.planning.data_parallel_time import DataParallelSeconds, DataParallelTime
from titanlite.planning.gpus import HBM_EFFICIENCY, GpuKind
from titanlite.planning.layout_memory import LayoutMemory, RankMemory, StageUnits
from titanlite.planning.link import Link
from titanlite.planning.run_plan import RunPlan

ZERO_BUBBLE_SHARE = 1 / 3
"""The zero-bubble schedule's bubble over interleaved 1F1B's: ZB-H1 (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024) leaves about a third of 1F1B's bubble when forward, input-backward and
weight-backward take equal time. It fills the bubble with deferred weight gradients of later
microbatches, so with fewer microbatches than pipeline ranks the interleaved bubble is kept."""
FLASH_BACKWARD = 2.5
"""Flash attention's backward FLOPs over its forward (five matmuls against two)."""
ADAM_BYTES_PER_PARAM = 32


@dataclass(frozen=True)
class Features:
    """Techniques beyond the training dtype: float8 (a run's `float8.enable`, and the published runs that
    used it), and async TP (for comparing with published runs only: titanlite does not have it)."""

    float8: bool = False
    """Block matmuls at the GPU's fp8 rate (torchao float8 on `nn.Linear`, output layer excluded)."""
    async_tp: bool = False
    """Tensor-parallel collectives hidden behind the matmuls they feed (async TP)."""


@dataclass
class StepTime:
    """Seconds per optimizer step and their parts (on the slowest pipeline rank)."""

    step: float
    compute: float
    recompute: float
    dp_comm: float
    """Exposed data-parallel collectives."""
    send_recv: float
    """The pipeline's exposed sends and receives of hidden states between stages."""
    bubble: float
    optimizer: float
    bubble_fraction: float
    tokens_per_gpu: float
    """Tokens per GPU per step (global batch tokens over the world)."""
    flops_per_token: float
    peak_tflops: float
    dp_comm_total: float = 0.0
    """Every data-parallel collective, hidden or not."""
    comm: dict[str, float] = field(default_factory=dict)
    """Exposed collectives of each parallelism unit with a step-time term, by its name, in their order."""
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_gpu / self.step

    @property
    def mfu(self) -> float:
        return 100 * self.flops_per_token * self.tokens_per_s / (self.peak_tflops * 1e12)

    @property
    def exposed_comm(self) -> float:
        units = 0.0
        for seconds in self.comm.values():
            units += seconds
        return units + self.dp_comm + self.send_recv


@dataclass(frozen=True)
class ComputeTimes:
    """Seconds of one microbatch's compute on a rank (every term over tp; module docstring)."""

    block_fwd: float
    block_bwd: float
    recompute: dict[str, float]
    """A block's recomputation in backward, by its AC mode."""
    out_mm: float
    """The output projection's forward (its backward: twice that)."""
    loss: float
    """The loss's elementwise work, forward and backward."""


@dataclass
class RankTime:
    """One pipeline rank's seconds per microbatch by part, and its data-parallel collectives."""

    compute: float
    recompute: float
    comm: dict[str, float]
    """Each parallelism unit's exposed collectives, by name, in their order."""
    pp: float
    """Pipeline sends and receives."""
    dp: DataParallelSeconds

    @property
    def per_microbatch(self) -> float:
        per_mb = self.compute + self.recompute
        for seconds in self.comm.values():
            per_mb += seconds
        return per_mb + self.pp + self.dp.per_microbatch


UnitTerm = tuple[str, Callable[[StageWork], float], Link]
"""A parallelism unit's name, its step-time term and the link its group runs on."""


@dataclass(frozen=True)
class MicrobatchModel:
    """What one microbatch costs a pipeline rank's stages, each part from its own term."""

    times: ComputeTimes
    modes: tuple[str, ...]
    """Each block's AC mode, by block index."""
    terms: list[UnitTerm]
    work: Callable[..., StageWork]
    """`StageWork` of this microbatch, given a stage's counts and a unit's ring."""
    send_recv: float
    """The pipeline's exposed sends and receives per stage."""
    dp: DataParallelTime

    def rank(self, rank: RankMemory) -> RankTime:
        compute = rec = pp = 0.0
        comm = dict.fromkeys((name for name, _, _ in self.terms), 0.0)
        dp = DataParallelSeconds()
        for st in rank.stages:
            fwd_c, bwd_c, comp, recs, counted = stage_compute(st, self.modes, self.times)
            compute += comp
            rec += recs
            for name, term, link in self.terms:
                comm[name] += term(self.work(*counted, ring=link.ring, all_to_all=link.all_to_all))
            pp += self.send_recv
            self.dp.add_stage(st, fwd_c, bwd_c, dp)
        return RankTime(compute, rec, comm, pp, dp)


class StepTimeModel:
    def __init__(self, cost: ModelCost, kind: GpuKind, features: Features = Features()):
        self.cost, self.kind, self.features = cost, kind, features
        self._block_modes: dict[tuple[str, str], tuple[str, ...]] = {}

    def estimate(self, plan: RunPlan, layout: Layout, memory: LayoutMemory) -> StepTime:
        """The step on its slowest pipeline rank: its microbatches, the bubble, the once-per-step
        collectives and the optimizer."""
        kind, sp, accum = self.kind, plan.pipeline, plan.grad_accum
        m = sp.microbatches if sp else 1
        n = m * accum
        one = self.microbatch(plan, layout, memory)
        ranks = [one.rank(r) for r in memory.ranks]
        worst = ranks[0]
        for r in ranks[1:]:
            if r.per_microbatch + r.dp.per_step / n > worst.per_microbatch + worst.dp.per_step / n:
                worst = r
        per_mb = worst.per_microbatch
        fraction = bubble_fraction(plan)
        bubble = m * per_mb * fraction / (1 - fraction)
        optimizer = self.optimizer(memory)
        step = accum * (m * per_mb + bubble) + worst.dp.per_step + optimizer
        shared = self._shared(plan, [n * r.per_microbatch + r.dp.per_step for r in ranks], step, optimizer)
        if shared is not None:
            step, bubble = shared[0], shared[1] / accum
        return StepTime(
            step=step,
            compute=n * worst.compute,
            recompute=n * worst.recompute,
            dp_comm=n * worst.dp.per_microbatch + worst.dp.per_step,
            send_recv=n * worst.pp,
            bubble=accum * bubble,
            optimizer=optimizer,
            bubble_fraction=fraction,
            tokens_per_gpu=plan.tokens_per_gpu_step,
            flops_per_token=self.cost.flops_per_token,
            peak_tflops=kind.peak_tflops,
            dp_comm_total=worst.dp.total,
            comm={name: n * seconds for name, seconds in worst.comm.items()},
        )

    def microbatch(self, plan: RunPlan, layout: Layout, memory: LayoutMemory) -> MicrobatchModel:
        """The terms of one microbatch of this layout (module docstring)."""
        cfg, dims = plan.cfg, plan.dims
        sp = plan.pipeline
        microbatch = cfg.parallelism.pipeline_parallel_microbatch_size if sp else cfg.training.local_batch_size
        tokens = microbatch * cfg.training.seq_len // dims.cp
        e = layout.compute_dtype.itemsize
        work = functools.partial(
            StageWork,
            microbatch=microbatch,
            seq_len=cfg.training.seq_len,
            tokens=tokens,
            itemsize=e,
            tp=dims.tp,
            cost=self.cost,
            features=self.features,
        )
        return MicrobatchModel(
            times=self.compute_times(plan, tokens, e),
            modes=self._modes(ActivationCheckpoint(layout.ac_mode, layout.ac_option), cost_blocks=memory.ranks),
            terms=self.unit_terms(plan),
            work=work,
            send_recv=self.send_recv(plan, tokens, e),
            dp=DataParallelTime(plan, layout, self.kind),
        )

    def compute_times(self, plan: RunPlan, tokens: int, e: int) -> ComputeTimes:
        """Forward, backward and recomputation of a block, the output projection and the loss, for
        `tokens` tokens of `e`-byte elements at the GPU's calibrated rates (module docstring)."""
        kind, cost, c = self.kind, self.cost, plan.cfg.compile
        eff = kind.training_efficiency
        fp32 = e == 4 and kind.fp32_matmul_tflops != kind.matmul_tflops
        scale = kind.fp32_matmul_tflops / kind.matmul_tflops if fp32 else 1.0
        mm_rate = kind.matmul_tflops * 1e12 * eff * scale
        block_mm_rate = kind.float8_matmul_tflops * 1e12 * eff if self.features.float8 else mm_rate
        attn_rate = kind.attention_tflops * 1e12 * eff * scale
        hbm = _hbm_bytes_per_s(kind)
        fused_blocks = c.enable and "model" in c.components
        fused_loss = c.enable and "loss" in c.components
        tp, b = plan.dims.tp, cost.block
        # Matmuls split over tp, and those every tp rank runs whole (a MoE layer tp does not split).
        split_mm = b.matmul_flops - b.replicated_matmul_flops
        blk_mm = tokens * (split_mm / tp + b.replicated_matmul_flops) / block_mm_rate
        blk_attn = tokens * b.attention_flops / tp / attn_rate
        blk_ew = tokens * (b.fused_elementwise_bytes if fused_blocks else b.elementwise_bytes) / tp / hbm
        blk_fwd = blk_mm + blk_attn + blk_ew
        recompute = {
            "none": 0.0,
            "full": blk_fwd,
            "op": tokens * b.op_recompute_flops / tp / block_mm_rate + blk_ew,
            "op_all_mm": blk_ew,
        }
        return ComputeTimes(
            block_fwd=blk_fwd,
            block_bwd=2 * blk_mm + FLASH_BACKWARD * blk_attn + 2 * blk_ew,
            recompute=recompute,
            out_mm=tokens * cost.output_matmul_flops / tp / mm_rate,
            loss=tokens * (cost.fused_loss_bytes if fused_loss else cost.loss_bytes) / tp / hbm,
        )

    def unit_terms(self, plan: RunPlan) -> list[UnitTerm]:
        """Each enabled parallelism unit's term and the link its group runs on (`ParallelismUnit.group`)."""
        dims = plan.dims
        return [
            (u.name, u.step_time, Link.of(self.kind, *u.group(dims)))
            for u in enabled(plan.cfg, dims)
            if u.step_time is not None and u.group is not None
        ]

    def send_recv(self, plan: RunPlan, tokens: int, e: int) -> float:
        """The pipeline's exposed sends: one hidden state per microbatch and stage boundary, forward and
        backward. Neighbouring stages are dp x cp x tp ranks apart: one pair per send."""
        dims, kind = plan.dims, self.kind
        if plan.pipeline is None:
            return 0.0
        gpn = kind.gpus_per_node
        link = Link(kind, dims.pp, 1 if dims.dp * dims.cp * dims.tp >= gpn or dims.world_size > gpn else dims.pp)
        return 2 * link.send(tokens * self.cost.hidden * e / dims.tp)

    def optimizer(self, memory: LayoutMemory) -> float:
        """AdamW on the rank with the most parameters, memory-bound (module docstring)."""
        return max(r.params for r in memory.ranks) / 4 * ADAM_BYTES_PER_PARAM / _hbm_bytes_per_s(self.kind)

    def _shared(self, plan: RunPlan, busy: list[float], step: float, optimizer: float) -> tuple[float, float] | None:
        """(step, bubble over the step's accumulation batches) when ranks share processors, else None: a
        waiting rank's share goes to the others, so a step takes the node's work over its processors, or
        the critical path at the speed of a rank running alone."""
        kind = self.kind
        share = min(plan.dims.world_size, kind.gpus_per_node) / kind.shared_processors if kind.shared_processors else 1
        if share <= 1:
            return None
        step = max(sum(busy) / len(busy) + optimizer, step / share)
        return step, max(0.0, step - optimizer - max(busy))

    def _modes(self, ac: ActivationCheckpoint, cost_blocks) -> tuple[str, ...]:
        """How each block is checkpointed (`activation_checkpoint.block_ac`), by block index."""
        key = (ac.mode, ac.selective_ac_option)
        if key not in self._block_modes:
            n = max(st.blocks.stop for r in cost_blocks for st in r.stages)
            self._block_modes[key] = tuple(block_ac(ac, i) for i in range(n))
        return self._block_modes[key]


def bubble_fraction(plan: RunPlan) -> float:
    """The schedule's bubble (`StageLayout.bubble_fraction`), the zero-bubble schedule's at
    `ZERO_BUBBLE_SHARE` of it with at least as many microbatches as pipeline ranks; none without PP."""
    sp = plan.pipeline
    if sp is None:
        return 0.0
    zero_bubble = sp.schedule == "InterleavedZeroBubble" and sp.microbatches >= sp.degree
    return sp.bubble_fraction * (ZERO_BUBBLE_SHARE if zero_bubble else 1)


def _hbm_bytes_per_s(kind: GpuKind) -> float:
    return kind.hbm_gbps * 1e9 * HBM_EFFICIENCY


def stage_compute(st: StageUnits, modes: tuple[str, ...], t: ComputeTimes):
    """For one microbatch through stage `st`: per gather unit, in forward order, the forward and the
    backward (+ recompute) compute it feeds; the stage's compute and recompute times; and what the
    parallelisms' terms count (`StageWork`: blocks, of them fully and selectively checkpointed, first,
    last). Blocks carry the block compute; the output projection and the loss go with the last unit."""
    n = len(st.numel)
    fwd_c, bwd_c = [0.0] * n, [0.0] * n
    rec = 0.0
    full = selective = 0
    for i, j in zip(st.blocks, st.block_positions):
        mode = modes[i]
        r = t.recompute[mode]
        fwd_c[j], bwd_c[j] = t.block_fwd, t.block_bwd + r
        rec += r
        full += mode == "full"
        selective += mode in ("op", "op_all_mm")
    nb = len(st.block_positions)
    compute = nb * (t.block_fwd + t.block_bwd)
    if st.last:
        compute += 3 * t.out_mm + t.loss
        fwd_c[-1] += t.out_mm
        bwd_c[-1] += 2 * t.out_mm + t.loss
    return fwd_c, bwd_c, compute, rec, (nb, full, selective, st.first, st.last)
