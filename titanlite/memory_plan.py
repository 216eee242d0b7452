"""Per-GPU memory estimate of a parallelized Llama 3: model state from real shard shapes, the rest modelled.

Parameters, gradients and AdamW state are counted from the local shapes of the parameters after the
parallelize plan ran (on the meta device in a dry run), so uneven shards and TP-replicated norms are
exact. Gradients have the parameter's dtype (fp32 master weights); AdamW keeps exp_avg and exp_avg_sq.

Collective buffers (compute dtype, TP-local full shapes): the weights gathered for forward that stay
alive until backward (`reshard_after_forward`: `never` = all, except SimpleFSDP's embedding weight,
whose backward needs only the token ids; `default` = the last block and the root's norm and output, or
FSDP2's whole root group; `always` = none) plus one gather unit in flight (a transformer block, or a
root weight if larger; FSDP2 prefetches the next unit, so two), plus one unit's unsharded gradients in
the reduce dtype before the reduce-scatter (all of them, when gradients are reduced once per step over
several backwards: `Layout.unreduced_grads`). Eager per-parameter gathers hold less than a block;
bucketed and compiled ones hold one.

Activations are the model family's own estimate (`ModelSpec.activation_bytes`; Llama 3's is in
`models/llama3/memory.py`). The total adds every part as if all peaked together, which is conservative.
Under pipeline parallelism (`pipeline_estimate`) each stage is estimated for one microbatch, and the
rank's activations scale what a microbatch saves by the microbatches its schedule keeps in flight.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.config import DTYPES, ActivationCheckpoint, JobConfig
from titanlite.parallelisms.activation_checkpoint import BlockAC, block_ac
from titanlite.parallelisms.gradient_reduction import reduces_once
from titanlite.parallelisms.parallel_dims import ParallelDims
from titanlite.parallelisms.reshard import ReshardPlan
from titanlite.parallelisms.units import Units

GiB = 2**30


@dataclass(frozen=True)
class Layout:
    """What the estimate needs to know about a run beyond the parameters' shapes."""

    tp: int
    dp_mode: str | None
    """SimpleFSDP mode (`fully_shard`, `replicate`, `hybrid_shard`), or None without data parallelism."""
    dp_impl: str
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    reshard: str
    loss_parallel: bool
    ac_mode: str
    ac_option: str
    local_batch: int
    """Samples per microbatch: the local batch, or the pipeline microbatch size under PP."""
    seq_len: int
    blocks: tuple[int, ...] | None = None
    """The blocks a pipeline stage holds (None: every block)."""
    output: bool = True
    """Whether the stage computes the output and the loss (the last pipeline stage, or no PP)."""
    unreduced_grads: bool = False
    """Gradients accumulate unsharded over the step's backwards, reduced once at its end
    (`parallelism.gradient_reduction` per_step with gradient accumulation or pipeline microbatches)."""

    @classmethod
    def from_config(cls, cfg: JobConfig, dims: ParallelDims, backwards_per_step: int) -> Layout:
        """The layout the trainer builds: mixed precision comes with the data-parallel plan (every run but
        pure tensor parallelism)."""
        p, t = cfg.parallelism, cfg.training
        dp = dims.dp_enabled
        return cls(
            tp=dims.tp,
            dp_mode=dims.dp_mode if dp else None,
            dp_impl=p.dp_impl,
            compute_dtype=DTYPES[t.mixed_precision_param] if dp else torch.float32,
            reduce_dtype=DTYPES[t.mixed_precision_reduce] if dp else torch.float32,
            reshard=p.fsdp_reshard_after_forward,
            loss_parallel=dims.loss_parallel,
            ac_mode=cfg.activation_checkpoint.mode,
            ac_option=cfg.activation_checkpoint.selective_ac_option,
            local_batch=t.local_batch_size,
            seq_len=t.seq_len,
            unreduced_grads=dp and backwards_per_step > 1 and reduces_once(p),
        )

    def stage(self, blocks: range, output: bool, microbatch: int) -> Layout:
        """The layout of one pipeline stage, one microbatch at a time."""
        return dataclasses.replace(self, blocks=tuple(blocks), output=output, local_batch=microbatch)

    def block_ac(self, layer: int) -> BlockAC:
        """`none`, `full` or `op` for one block, as activation_checkpoint.apply_ac wraps it."""
        return block_ac(ActivationCheckpoint(self.ac_mode, self.ac_option), layer)


@dataclass
class MemoryEstimate:
    """Bytes per GPU; `total` sums every part."""

    local_numel: dict[str, int]
    params: int
    grads: int
    optimizer: int
    gather_held: int
    gather_in_flight: int
    reduce_buffer: int
    activations: int
    activation_parts: dict[str, int] = field(default_factory=dict)

    @property
    def collective_buffers(self) -> int:
        return self.gather_held + self.gather_in_flight + self.reduce_buffer

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.collective_buffers + self.activations


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def gathered_numel(p: torch.Tensor) -> int:
    """Elements of `p` after gathering over the data-parallel mesh dims: TP shards stay sharded."""
    if not isinstance(p, DTensor):
        return p.numel()
    shape = list(p.shape)
    mesh = p.device_mesh
    for i, (name, placement) in enumerate(zip(mesh.mesh_dim_names or (), p.placements)):
        if not name.startswith("dp") and placement.is_shard():
            shape[placement.dim] = math.ceil(shape[placement.dim] / mesh.size(i))
    return math.prod(shape)


def gather_unit(fqn: str, units: Units, dp_impl: str) -> str:
    """The gather unit of a parameter: its transformer block; outside the blocks the parameter itself
    (SimpleFSDP gathers per parameter) or FSDP2's root group (embedding, final norm and output together)."""
    return units.unit_of(fqn) or ("root" if dp_impl == "fsdp2" else fqn)


def _collective_buffers(model: nn.Module, units: Units, layout: Layout) -> tuple[int, int, int]:
    """(gathered weights held from forward to backward, gathers in flight, unreduced gradients) in bytes."""
    if layout.dp_mode is None:
        return 0, 0, 0
    gathered_bytes = layout.compute_dtype.itemsize
    model_units, units = units, {}
    for fqn, p in model.named_parameters():
        unit = gather_unit(fqn, model_units, layout.dp_impl)
        units[unit] = units.get(unit, 0) + gathered_numel(p)
    # The embedding's (the modules before the blocks) backward needs only the token ids: SimpleFSDP frees
    # its gathered weight after forward.
    kept = [u for u in units if not _under(u, model_units.before)]
    if layout.dp_mode == "replicate":
        # No gather: at most a cast of each full weight, kept for backward like an unresharded gather.
        if layout.compute_dtype == next(model.parameters()).dtype:
            return 0, 0, 0
        held = set(kept)
    else:
        plan = ReshardPlan.of(layout.reshard, len(model_units.blocks))
        prefixes = plan.kept(model_units) + (() if plan.root else ("root",))
        held = {u for u in kept if _under(u, prefixes)}
    free = sorted((n for u, n in units.items() if u not in held), reverse=True)
    in_flight = sum(free[: 2 if layout.dp_impl == "fsdp2" else 1])
    if layout.unreduced_grads:  # every gradient, unsharded, until the step's one reduction
        reduce_elems = sum(units.values())
    else:
        reduce_elems = 0 if layout.dp_mode == "replicate" else max(units.values())
    return (
        sum(units[u] for u in held) * gathered_bytes,
        in_flight * gathered_bytes,
        reduce_elems * layout.reduce_dtype.itemsize,
    )


def _under(fqn: str, prefixes: tuple[str, ...]) -> bool:
    return any(fqn == p or fqn.startswith(p + ".") for p in prefixes)


def estimate(model: nn.Module, units: Units, activations: dict[str, int], layout: Layout) -> MemoryEstimate:
    """Memory per GPU of `model` (already parallelized, on any device including meta) under `layout`;
    `units` are its blocks and roots, `activations` the family's estimate (parts and "peak", in bytes)."""
    local = {fqn: local_tensor(p).numel() for fqn, p in model.named_parameters()}
    param_bytes = sum(local_tensor(p).nbytes for p in model.parameters())
    trainable = sum(local_tensor(p).nbytes for p in model.parameters() if p.requires_grad)
    held, in_flight, reduce = _collective_buffers(model, units, layout)
    acts = dict(activations)
    peak = acts.pop("peak")
    acts.pop("held", None)
    return MemoryEstimate(
        local_numel=local,
        params=param_bytes,
        grads=trainable,
        optimizer=2 * trainable,
        gather_held=held,
        gather_in_flight=in_flight,
        reduce_buffer=reduce,
        activations=peak,
        activation_parts=acts,
    )


@dataclass(frozen=True)
class StageMemory:
    """One pipeline stage of a rank: its estimate (one microbatch's activations) and what one microbatch
    leaves saved for backward (`held`), which the schedule multiplies by the microbatches in flight."""

    stage: int
    estimate: MemoryEstimate
    held: int


def pipeline_estimate(stages: list[StageMemory], in_flight: int, unreduced_grads: bool) -> MemoryEstimate:
    """A pipeline rank's memory: its stages' model state and kept gathers add up; one gather and one
    reduce-scatter are in flight at a time (the largest), unless the gradients stay unreduced until the
    step's end (`Layout.unreduced_grads`: every stage's add up); each stage holds the activations of `in_flight`
    microbatches waiting for backward, while one microbatch runs the largest backward peak above what it
    had saved."""
    es = [s.estimate for s in stages]
    parts = {f"stage {s.stage} saved x {in_flight} microbatches": in_flight * s.held for s in stages}
    parts["one microbatch's backward peak"] = max(s.estimate.activations - s.held for s in stages)
    return MemoryEstimate(
        local_numel={k: v for e in es for k, v in e.local_numel.items()},
        params=sum(e.params for e in es),
        grads=sum(e.grads for e in es),
        optimizer=sum(e.optimizer for e in es),
        gather_held=sum(e.gather_held for e in es),
        gather_in_flight=max(e.gather_in_flight for e in es),
        reduce_buffer=(sum if unreduced_grads else max)(e.reduce_buffer for e in es),
        activations=sum(parts.values()),
        activation_parts=parts,
    )
