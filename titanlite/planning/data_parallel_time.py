"""Data parallelism's term of the step-time model (`step_time.py`): the exposed time of its gathers and
reductions on one pipeline rank, per microbatch and per step.

Per gather unit (a block, or a root parameter / FSDP2's root group): the forward all-gather, the backward
re-gather of units resharded after forward, and the gradient reduction in every backward or once per step,
over dp_shard x cp; one collective per unit where something buckets them, else one per parameter. A
gather moves its unit's bytes as the memory estimate counts them (`memory.gathered_bytes`). Overlap
follows what the implementation schedules (`prefetches`): FSDP2 and SimpleFSDP compiled as one graph
with bucketing hide a unit's collectives behind its neighbour's compute; SimpleFSDP eager or compiled per
block exposes them all.
"""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.compile.compiler import compile_scope
from titanlite.parallelisms.layout import Layout
from titanlite.planning.gpus import GpuKind
from titanlite.planning.layout_memory import StageUnits
from titanlite.planning.link import Link
from titanlite.planning.memory import gathered_bytes
from titanlite.planning.run_plan import RunPlan


def prefetches(plan: RunPlan) -> bool:
    """Whether the data-parallel implementation overlaps a unit's collectives with its neighbour's compute:
    FSDP2, SimpleFSDP compiled as one graph (`compile_scope` model) whose passes bucket and reorder, or
    per-block graphs with the eager prefetcher (`prefetch`)."""
    if plan.cfg.parallelism.dp_impl == "fsdp2":
        return True
    c = plan.cfg.compile
    scope = compile_scope(plan.cfg, plan.dims) if plan.compile_passes else None
    return scope == "prefetch" or (scope == "model" and c.bucketing != "none" and c.reorder)


def _overlapped(comm: list[float], compute: list[float]) -> float:
    """Exposed time of per-unit collectives each needed before its unit's compute, each issued while the
    previous unit computes (one ahead)."""
    if not comm:
        return 0.0
    return comm[0] + sum(max(0.0, g - c) for g, c in zip(comm[1:], compute[:-1]))


@dataclass
class DataParallelSeconds:
    """One pipeline rank's data-parallel collectives, summed over its stages."""

    per_microbatch: float = 0.0
    """Exposed in every microbatch."""
    per_step: float = 0.0
    """Exposed once per step (gathers kept for the step, reductions once per step)."""
    total: float = 0.0
    """Every collective of a step, hidden or not."""


class DataParallelTime:
    """The data-parallel collectives of a layout's stages (module docstring)."""

    def __init__(self, plan: RunPlan, layout: Layout, kind: GpuKind):
        sp, accum = plan.pipeline, plan.grad_accum
        self.microbatches = (sp.microbatches if sp else 1) * accum
        """Microbatches of a step: each runs every collective that is not once per step."""
        fsdp2 = plan.cfg.parallelism.dp_impl == "fsdp2"
        self.prefetch = prefetches(plan) and kind.comm_overlaps_compute
        # How often a step gathers each unit forward and again backward: every microbatch; once per schedule
        # step for FSDP2 under torch's pipeline stage (unsharded from the first backward to the last); once
        # per step when the step policy keeps the gathers (nothing is gathered again).
        if sp is not None and fsdp2:
            self.n_fwd = self.n_regather = accum
        elif layout.keep_gathers:
            self.n_fwd, self.n_regather = 1, 0
        else:
            self.n_fwd = self.n_regather = self.microbatches
        # Reductions: every backward; or once per step (per schedule step for FSDP2 under PP), inside the
        # last backward for FSDP2, after it for SimpleFSDP.
        self.once = layout.unreduced_grads
        self.reductions = self.microbatches if not self.once else (accum if sp is not None and fsdp2 else 1)
        self.reduce_in_graph = not self.once or fsdp2
        self.layout = layout
        self.gather, self.reduce = self._rates(plan, layout, kind)
        c = plan.cfg.compile
        self.bucketed = fsdp2 or (c.enable and c.bucketing != "none" and "model" in c.components)

    @staticmethod
    def _rates(plan: RunPlan, layout: Layout, kind: GpuKind) -> tuple[tuple[float, float], tuple[float, float]]:
        """(seconds per byte, latency) of a unit's gather; (seconds per element, latency) of its gradients'
        reduction."""
        dims, dp_mode = plan.dims, layout.dp_mode
        tp, shard = dims.tp, dims.shard_degree
        shard_link = Link.of(kind, shard, tp)  # dp_shard x cp, one group (`ParallelDims.param_mesh`)
        rep_link = Link.of(kind, dims.dp_replicate, tp * shard)
        r_e = layout.reduce_dtype.itemsize
        gather = shard_link.linear(1) if dp_mode not in (None, "replicate") else (0.0, 0.0)
        if dp_mode is None:
            return gather, (0.0, 0.0)
        if dp_mode == "replicate":
            return gather, rep_link.linear(r_e, all_reduce=True)
        a, la = shard_link.linear(r_e)
        b, lb = rep_link.linear(r_e / shard, all_reduce=True)
        return gather, (a + b, la + lb)

    def add_stage(self, st: StageUnits, fwd_c: list[float], bwd_c: list[float], into: DataParallelSeconds) -> None:
        """Add one stage's collectives to its rank's; `fwd_c`, `bwd_c`: per unit, the forward and the
        backward compute it overlaps with."""
        g, regather, red = self._collectives(st)
        into.total += sum(g) * self.n_fwd + sum(regather) * self.n_regather + sum(red) * self.reductions
        # Forward gathers, backward re-gathers and (when every backward reduces) reductions: in every
        # microbatch, or in as many of the step's passes as they happen in.
        fwd_exp = self._exposed(g, fwd_c)
        per_mb_red = self.reduce_in_graph and self.reductions == self.microbatches
        bwd = [a + r for a, r in zip(regather, red)] if per_mb_red else regather
        bwd_exp = self._exposed(bwd[::-1], bwd_c[::-1])
        self._add(into, self.n_fwd, fwd_exp)
        self._add(into, self.n_regather, bwd_exp)
        if not per_mb_red and self.reduce[0]:
            into.per_step += self.reductions * self._step_reduction(red, bwd_c)

    def _collectives(self, st: StageUnits) -> tuple[list[float], list[float], list[float]]:
        """Per unit, in forward order: its gather, its re-gather for backward, its gradients' reduction."""
        (g_coef, g_lat), (r_coef, r_lat) = self.gather, self.reduce
        counts = [1] * len(st.numel) if self.bucketed else st.n_tensors
        nbytes = [gathered_bytes(self.layout, n, f8) for n, f8 in zip(st.numel, st.float8_numel)]
        g = [g_coef * b + g_lat * k for b, k in zip(nbytes, counts)] if g_coef else [0.0] * len(counts)
        regather = [x if again else 0.0 for x, again in zip(g, st.regathered)]
        red_counts = counts if not self.once else [1] * len(counts)  # once per step: ~64 MiB buckets
        red = [r_coef * n + r_lat * k for n, k in zip(st.numel, red_counts)] if r_coef else [0.0] * len(counts)
        return g, regather, red

    def _exposed(self, comm: list[float], compute: list[float]) -> float:
        return _overlapped(comm, compute) if self.prefetch else sum(comm)

    def _add(self, into: DataParallelSeconds, n: int, exposed: float) -> None:
        """Collectives that run `n` times a step: per microbatch when every microbatch runs them."""
        if n == self.microbatches:
            into.per_microbatch += exposed
        else:
            into.per_step += n * exposed

    def _step_reduction(self, red: list[float], bwd_c: list[float]) -> float:
        """The exposed once-per-step reduction: inside the last backward it overlaps like any reduction."""
        step_red = sum(red)
        if self.reduce_in_graph and self.prefetch:
            step_red = max(0.0, step_red - sum(bwd_c)) + red[0]
        return step_red
