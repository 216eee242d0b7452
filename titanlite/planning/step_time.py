"""How long one optimizer step takes on a GPU kind, for a layout: compute, recomputation, exposed
communication, the pipeline bubble and the optimizer, from the model's cost per token
(`models/cost.py`), the layout's gather units (`layout_memory.py`) and the GPU's figures (`gpus.py`).

Compute, per microbatch and pipeline rank (tokens = microbatch x seq_len / cp, every term over tp):
    forward    matmuls / matmul rate + attention / attention rate + elementwise bytes / HBM bandwidth
    backward   2 x the matmuls, 2.5 x the attention (flash attention's backward), 2 x the elementwise
    recompute  full AC: the block's forward again; `op`: the matmuls it does not save; `op_all_mm` and
               every AC mode: the elementwise forward again
The last stage adds the output projection and the loss. Rates are the GPU's achievable ones times its
calibrated training efficiency; eager kernels move `elementwise_bytes`, compiled ones the fused bytes.
Under context parallelism a rank holds seq_len / cp tokens of each sequence and its queries attend to
the whole sequence's keys: the head-tail sharding gives every rank the same share of the causal
attention work, so attention too is the whole sequence's over cp. Attention runs at the flash rate
whatever the kernel (under cp, and under block_causal, CUDA runs flex attention with a block mask: its
rate against flash attention's is assumed equal, not measured).

Collectives (tensor and context parallelism's are their units' terms, `parallelism.Parallelism.step_time`,
summed by name into `StepTime.comm`; data parallelism's and the pipeline's are here. Ring: an all-gather
or reduce-scatter moves (p-1)/p of the unsharded bytes per rank, an all-reduce twice that; plus a fixed
latency). A group spans nodes when its ranks do (the mesh is laid
out pp, dp_replicate, dp_shard, cp, tp, innermost fastest); then it runs at the network's per-GPU
bandwidth, else at NVLink's.
    tensor parallel   `tp_collectives` hidden-state all-gathers/reduce-scatters per block and pass
                      (forward, backward, and the forward again under full AC; selective AC repeats
                      `tp_recomputed_selective`); exposed: they sit between the matmuls that need them
    data parallel     per gather unit (a block, or a root parameter / FSDP2's root group): the forward
                      all-gather, the backward re-gather of units resharded after forward, the gradient
                      reduce-scatter (all-reduce when replicating; both under HSDP) in every backward,
                      or once per step when gradients are reduced once per step; the shard group
                      is dp_shard x cp (context-parallel ranks hold parameter shards too)
    context parallel  per block: the all-gather of the whole sequence's keys and values (TP-local, compute
                      dtype) over the cp ranks before attention, its reduce-scatter of their gradients
                      in backward, and the all-gather again when the block is recomputed (full or
                      selective AC: the selective policy saves no all-gather); exposed: attention waits
                      for the gather, and the keys' and values' projections' backward for the
                      reduction, with nothing scheduled between them
    pipeline          one hidden state per microbatch and stage boundary, forward and backward, exposed
Overlap follows what the implementation schedules (`prefetches`): FSDP2, and SimpleFSDP compiled as one
graph with bucketing and reordering, gather the next unit while the current one computes and reduce a
unit's gradients while the next computes (exposed = the first gather, the last reduction, and what a
unit's collectives take beyond its neighbour's compute); SimpleFSDP eager or compiled per block issues
each unit's collectives next to its compute (buckets cannot cross compiled blocks): all exposed.
Reductions once per step after the last backward (SimpleFSDP) have nothing left to overlap.

A schedule step of m microbatches on pipeline ranks whose slowest takes T per microbatch lasts
m T / (1 - bubble) with the schedule's bubble (`StagePlan.bubble_fraction`; the zero-bubble schedule
at `ZERO_BUBBLE_SHARE` of it). The step adds its accumulation batches, the once-per-step reductions
and AdamW (reads parameter, gradient and both moments, writes three, reads the gradient for the norm:
32 bytes per fp32 parameter, memory-bound).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from titanlite.config import ActivationCheckpoint
from titanlite.models.cost import ModelCost
from titanlite.parallelisms.activation_checkpoint import block_ac
from titanlite.parallelisms.compile import compile_scope
from titanlite.parallelisms.memory_plan import Layout
from titanlite.parallelisms.parallelism import StageWork
from titanlite.parallelisms.parallelize import enabled
from titanlite.plan import RunPlan
from titanlite.planning.gpus import COLLECTIVE_EFFICIENCY, HBM_EFFICIENCY, GpuKind
from titanlite.planning.layout_memory import LayoutMemory, StageUnits

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
    """Techniques titanlite does not have, for comparing with published runs that used them only."""

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
    pp_comm: float
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
    def tp_comm(self) -> float:
        """Exposed tensor-parallel collectives."""
        return self.comm.get("tensor", 0.0)

    @property
    def cp_comm(self) -> float:
        """Context-parallel K/V all-gathers and their gradients' reduce-scatters (all exposed)."""
        return self.comm.get("context", 0.0)

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
        return units + self.dp_comm + self.pp_comm


def prefetches(plan: RunPlan) -> bool:
    """Whether the data-parallel implementation overlaps a unit's collectives with its neighbour's compute:
    FSDP2, SimpleFSDP compiled as one graph (`compile_scope` model) whose passes bucket and reorder, or
    per-block graphs with the eager prefetcher (`prefetch`)."""
    if plan.cfg.parallelism.dp_impl == "fsdp2":
        return True
    c = plan.cfg.compile
    scope = compile_scope(plan.cfg, plan.dims) if plan.compile_passes else None
    return scope == "prefetch" or (scope == "model" and c.bucketing != "none" and c.reorder)


class Link:
    """Collective times over one mesh dim's group of `size` ranks, `per_node` of them on each node.

    Within a node: NVLink. Across nodes NCCL runs one ring per NIC, so a group with k members per node
    crosses the network through k NICs at once: min(NVLink, k x network) per GPU (nccl-tests' multi-node
    bus bandwidth on 8-GPU nodes with a NIC per GPU is about eight times one NIC's)."""

    def __init__(self, kind: GpuKind, size: int, per_node: int):
        self.size = size
        inter = size > per_node
        bw = min(kind.nvlink_gbps, per_node * kind.network_gbps) if inter else kind.nvlink_gbps
        self.bytes_per_s = bw * 1e9 * COLLECTIVE_EFFICIENCY
        self.latency = kind.inter_latency_s if inter else kind.intra_latency_s

    @classmethod
    def of(cls, kind: GpuKind, size: int, stride: int) -> Link:
        """The group of `size` ranks `stride` apart (ranks fill nodes of `kind.gpus_per_node` in order)."""
        return cls(kind, size, max(1, min(size, kind.gpus_per_node // stride)))

    def ring(self, nbytes: float, all_reduce: bool = False) -> float:
        """An all-gather or reduce-scatter of `nbytes` unsharded bytes (an all-reduce: twice the traffic)."""
        if self.size == 1 or nbytes == 0:
            return 0.0
        share = (self.size - 1) / self.size * (2 if all_reduce else 1)
        return share * nbytes / self.bytes_per_s + self.latency

    def send(self, nbytes: float) -> float:
        return 0.0 if self.size == 1 else nbytes / self.bytes_per_s + self.latency


def _overlapped(comm: list[float], compute: list[float]) -> float:
    """Exposed time of per-unit collectives each needed before its unit's compute, each issued while the
    previous unit computes (one ahead)."""
    if not comm:
        return 0.0
    return comm[0] + sum(max(0.0, g - c) for g, c in zip(comm[1:], compute[:-1]))


class StepTimeModel:
    def __init__(self, cost: ModelCost, kind: GpuKind, features: Features = Features()):
        self.cost, self.kind, self.features = cost, kind, features
        self._block_modes: dict[tuple[str, str], tuple[str, ...]] = {}

    def estimate(self, plan: RunPlan, layout: Layout, memory: LayoutMemory) -> StepTime:
        cfg, dims, kind, cost = plan.cfg, plan.dims, self.kind, self.cost
        gpn, e = kind.gpus_per_node, layout.compute_dtype.itemsize
        eff = kind.training_efficiency
        fp32 = e == 4 and kind.fp32_matmul_tflops != kind.matmul_tflops
        scale = kind.fp32_matmul_tflops / kind.matmul_tflops if fp32 else 1.0
        mm_rate = kind.matmul_tflops * 1e12 * eff * scale
        block_mm_rate = kind.float8_matmul_tflops * 1e12 * eff if self.features.float8 else mm_rate
        attn_rate = kind.attention_tflops * 1e12 * eff * scale
        hbm = kind.hbm_gbps * 1e9 * HBM_EFFICIENCY
        compiled = cfg.compile.enable
        fused_blocks = compiled and "model" in cfg.compile.components
        fused_loss = compiled and "loss" in cfg.compile.components
        tp = dims.tp
        cp, shard = dims.cp, dims.shard_degree
        # Each parallelism unit's term and the link its group runs on (`parallelism.Parallelism.group`).
        terms = [
            (u.name, u.step_time, Link.of(kind, *u.group(dims)))
            for u in enabled(dims)
            if u.step_time is not None and u.group is not None
        ]
        shard_link = Link.of(kind, shard, tp)  # dp_shard x cp, one group (`ParallelDims.param_mesh`)
        rep_link = Link.of(kind, dims.dp_replicate, tp * shard)
        # Neighbouring stages are dp x cp x tp ranks apart: one pair per send.
        pp_link = Link(kind, dims.pp, 1 if dims.dp * cp * tp >= gpn or dims.world_size > gpn else dims.pp)
        sp = plan.pipeline
        microbatch = cfg.parallelism.pipeline_parallel_microbatch_size if sp else cfg.training.local_batch_size
        tokens = microbatch * cfg.training.seq_len // cp
        m = sp.microbatches if sp else 1
        accum = plan.grad_accum
        ac = ActivationCheckpoint(layout.ac_mode, layout.ac_option)
        b = cost.block
        blk_mm = tokens * b.matmul_flops / tp / block_mm_rate
        blk_attn = tokens * b.attention_flops / tp / attn_rate
        blk_ew = tokens * (b.fused_elementwise_bytes if fused_blocks else b.elementwise_bytes) / tp / hbm
        blk_fwd = blk_mm + blk_attn + blk_ew
        blk_bwd = 2 * blk_mm + FLASH_BACKWARD * blk_attn + 2 * blk_ew
        recompute = {
            "none": 0.0,
            "full": blk_fwd,
            "op": tokens * b.op_recompute_flops / tp / block_mm_rate + blk_ew,
            "op_all_mm": blk_ew,
        }
        hidden_bytes = tokens * cost.hidden * e
        work = functools.partial(
            StageWork,
            microbatch=microbatch,
            seq_len=cfg.training.seq_len,
            tokens=tokens,
            itemsize=e,
            tp=tp,
            cost=cost,
            features=self.features,
        )
        out_mm = tokens * cost.output_matmul_flops / tp / mm_rate
        loss_ew = tokens * (cost.fused_loss_bytes if fused_loss else cost.loss_bytes) / tp / hbm
        prefetch = prefetches(plan) and kind.comm_overlaps_compute
        dp_mode = layout.dp_mode
        mb_total = m * accum
        fsdp2 = cfg.parallelism.dp_impl == "fsdp2"
        # How often a step gathers each unit forward and again backward: every microbatch; once per schedule
        # step for FSDP2 under torch's pipeline stage (unsharded from the first backward to the last); once
        # per step when the step policy keeps the gathers (nothing is gathered again).
        if sp is not None and fsdp2:
            n_fwd = n_regather = accum
        elif layout.keep_gathers:
            n_fwd, n_regather = 1, 0
        else:
            n_fwd = n_regather = mb_total
        # Reductions: every backward; or once per step (per schedule step for FSDP2 under PP), inside the
        # last backward for FSDP2, after it for SimpleFSDP.
        once = layout.unreduced_grads
        reductions = mb_total if not once else (accum if sp is not None and fsdp2 else 1)
        reduce_in_graph = not once or fsdp2
        r_e = layout.reduce_dtype.itemsize
        g_coef, g_lat = _linear(shard_link, e) if dp_mode not in (None, "replicate") else (0.0, 0.0)
        if dp_mode is None:
            r_coef, r_lat = 0.0, 0.0
        elif dp_mode == "replicate":
            r_coef, r_lat = _linear(rep_link, r_e, all_reduce=True)
        else:
            a, la = _linear(shard_link, r_e)
            b_, lb = _linear(rep_link, r_e / shard, all_reduce=True)
            r_coef, r_lat = a + b_, la + lb
        modes = self._modes(ac, cost_blocks=memory.ranks)
        # One collective per unit where something buckets them (FSDP2's groups, the compile passes), else
        # one per parameter (SimpleFSDP eager or compiled without bucketing), as the compile report counts.
        c = cfg.compile
        bucketed = fsdp2 or (c.enable and c.bucketing != "none" and "model" in c.components)
        p2p = 2 * pp_link.send(hidden_bytes / tp) if sp is not None else 0.0

        def exposed(comm: list[float], compute: list[float]) -> float:
            return _overlapped(comm, compute) if prefetch else sum(comm)

        worst = None
        busy: list[float] = []
        for rank in memory.ranks:
            compute = rec = pp_t = 0.0
            dp_mb = dp_step = dp_total = 0.0
            comm = dict.fromkeys((name for name, _, _ in terms), 0.0)
            for st in rank.stages:
                fwd_c, bwd_c, comp, recs, counted = self._stage_compute(
                    st, modes, blk_fwd, blk_bwd, recompute, out_mm, loss_ew
                )
                compute += comp
                rec += recs
                for name, term, link in terms:
                    comm[name] += term(work(*counted, ring=link.ring))
                pp_t += p2p
                counts = [1] * len(st.numel) if bucketed else st.n_tensors
                g = [g_coef * n + g_lat * k for n, k in zip(st.numel, counts)] if g_coef else [0.0] * len(counts)
                regather = [x if again else 0.0 for x, again in zip(g, st.regathered)]
                red_counts = counts if not once else [1] * len(counts)  # once per step: ~64 MiB buckets
                red = [r_coef * n + r_lat * k for n, k in zip(st.numel, red_counts)] if r_coef else [0.0] * len(counts)
                dp_total += sum(g) * n_fwd + sum(regather) * n_regather + sum(red) * reductions
                # Forward gathers, backward re-gathers and (when every backward reduces) reductions: in
                # every microbatch, or in as many of the step's passes as they happen in.
                fwd_exp = exposed(g, fwd_c)
                per_mb_red = reduce_in_graph and reductions == mb_total
                bwd = [a + r for a, r in zip(regather, red)] if per_mb_red else regather
                bwd_exp = exposed(bwd[::-1], bwd_c[::-1])
                if n_fwd == mb_total:
                    dp_mb += fwd_exp
                else:
                    dp_step += n_fwd * fwd_exp
                if n_regather == mb_total:
                    dp_mb += bwd_exp
                else:
                    dp_step += n_regather * bwd_exp
                if not per_mb_red and r_coef:
                    step_red = sum(red)
                    if reduce_in_graph and prefetch:  # inside the last backward, overlapped like any reduction
                        step_red = max(0.0, step_red - sum(bwd_c)) + red[0]
                    dp_step += reductions * step_red
            per_mb = compute + rec
            for seconds in comm.values():  # the units' terms, in their order
                per_mb += seconds
            per_mb = per_mb + pp_t + dp_mb
            row = (per_mb, compute, rec, comm, pp_t, dp_mb, dp_step, dp_total)
            busy.append(mb_total * per_mb + dp_step)
            if worst is None or per_mb + dp_step / mb_total > worst[0] + worst[6] / mb_total:
                worst = row
        assert worst is not None
        per_mb, compute, rec, comm, pp_t, dp_mb, dp_step, dp_total = worst
        bubble_fraction = 0.0
        if sp is not None:
            zero_bubble = sp.schedule == "InterleavedZeroBubble" and sp.microbatches >= sp.degree
            bubble_fraction = sp.bubble_fraction * (ZERO_BUBBLE_SHARE if zero_bubble else 1)
        bubble = m * per_mb * bubble_fraction / (1 - bubble_fraction)
        optimizer = max(r.params for r in memory.ranks) / 4 * ADAM_BYTES_PER_PARAM / hbm
        n = m * accum
        step = accum * (m * per_mb + bubble) + dp_step + optimizer
        share = min(dims.world_size, kind.gpus_per_node) / kind.shared_processors if kind.shared_processors else 1
        if share > 1:
            # Ranks share processors: a waiting rank's share goes to the others, so a step takes the node's
            # work over its processors, or the critical path at the speed of a rank running alone.
            step = max(sum(busy) / len(busy) + optimizer, step / share)
            bubble = max(0.0, step - optimizer - max(busy)) / accum
        return StepTime(
            step=step,
            compute=n * compute,
            recompute=n * rec,
            dp_comm=n * dp_mb + dp_step,
            pp_comm=n * pp_t,
            bubble=accum * bubble,
            optimizer=optimizer,
            bubble_fraction=bubble_fraction,
            tokens_per_gpu=plan.tokens_per_gpu_step,
            flops_per_token=cost.flops_per_token,
            peak_tflops=kind.peak_tflops,
            dp_comm_total=dp_total,
            comm={name: n * seconds for name, seconds in comm.items()},
        )

    def _modes(self, ac: ActivationCheckpoint, cost_blocks) -> tuple[str, ...]:
        """How each block is checkpointed (`activation_checkpoint.block_ac`), by block index."""
        key = (ac.mode, ac.selective_ac_option)
        if key not in self._block_modes:
            n = max(st.blocks.stop for r in cost_blocks for st in r.stages)
            self._block_modes[key] = tuple(block_ac(ac, i) for i in range(n))
        return self._block_modes[key]

    def _stage_compute(self, st: StageUnits, modes, blk_fwd, blk_bwd, recompute, out_mm, loss_ew):
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
            r = recompute[mode]
            fwd_c[j], bwd_c[j] = blk_fwd, blk_bwd + r
            rec += r
            full += mode == "full"
            selective += mode in ("op", "op_all_mm")
        nb = len(st.block_positions)
        compute = nb * (blk_fwd + blk_bwd)
        if st.last:
            compute += 3 * out_mm + loss_ew
            fwd_c[-1] += out_mm
            bwd_c[-1] += 2 * out_mm + loss_ew
        return fwd_c, bwd_c, compute, rec, (nb, full, selective, st.first, st.last)


def _linear(link: Link, bytes_per_elem: float, all_reduce: bool = False) -> tuple[float, float]:
    """(seconds per element, latency) of `link.ring` on a unit of elements of `bytes_per_elem` bytes."""
    if link.size == 1:
        return 0.0, 0.0
    share = (link.size - 1) / link.size * (2 if all_reduce else 1)
    return share * bytes_per_elem / link.bytes_per_s, link.latency
