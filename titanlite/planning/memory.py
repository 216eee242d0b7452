"""Per-GPU memory estimate of a parallelized model: model state from real shard shapes, the rest modelled.

Parameters, gradients and AdamW state are counted from the local shapes of the parameters after the
parallelize plan ran (on the meta device in a dry run), so uneven shards and TP-replicated norms are exact.
Data parallelism's buffers (`gather_buffers`) follow the reshard and step policies: gathered weights held
to backward or kept for the step, the gathers in flight, the gradients before their reduction and its
packing, SimpleFSDP's float8 shards. Activations are the model family's own estimate
(`ModelSpec.planning.activation_bytes`); under pipeline parallelism `pipeline_estimate` scales a stage's by
the microbatches its schedule keeps in flight and adds torch's stage buffers (`stage_runtime`). The total
adds every part as if all peaked together, which is conservative; `first_fitting` picks the step policy
from it. docs/dry_run.md and docs/parallelism.md give each rule and its measurements.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from titanlite.parallelisms.data_parallel.reshard import ReshardPolicy
from titanlite.parallelisms.layout import Layout
from titanlite.parallelisms.step_policy import StepPolicy
from titanlite.parallelisms.units import Units

GiB = 2**30

COMFORT_FRACTION = 0.9
"""An estimate fits comfortably when its total is at most this share of the GPU's memory: the rest is for the
CUDA context, NCCL's buffers and allocator fragmentation. Above it the dry run calls a layout tight, and
`first_fitting` takes a policy that holds less."""


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
    reduce_transient: int = 0
    """The once-per-step reduction's packing: one bucket (or the largest gradient) and its reduced shard."""
    receive_buffers: int = 0
    """Under PP: torch's stage buffers that receive each microbatch's activations and gradients
    (`stage_runtime`), beyond the stage inputs the blocks already save."""
    held_units: frozenset[str] = frozenset()
    """The gather units (`gather_unit`) whose gathered weights are held from forward to backward or kept for
    the step: what `gather_held` counts, by name."""
    float8_shards: int = 0
    """SimpleFSDP's float8 bits of each float8 weight's local shard and its scale, for the run
    (`float8_shard_bytes`)."""

    @property
    def collective_buffers(self) -> int:
        return (
            self.gather_held
            + self.gather_in_flight
            + self.reduce_buffer
            + self.reduce_transient
            + self.receive_buffers
            + self.float8_shards
        )

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.collective_buffers + self.activations


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor  # here: the run plan imports this module without DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def gathered_numel(p: torch.Tensor) -> int:
    """Elements of `p` after gathering over the data-parallel mesh dims (`dp_*`, and `cp`, over which the
    parameters are sharded like over dp_shard: `ParallelDims.param_mesh`): TP shards stay sharded."""
    from torch.distributed.tensor import DTensor  # here: the run plan imports this module without DTensor

    if not isinstance(p, DTensor):
        return p.numel()
    shape = list(p.shape)
    mesh = p.device_mesh
    for i, (name, placement) in enumerate(zip(mesh.mesh_dim_names or (), p.placements)):
        if not (name.startswith("dp") or name == "cp") and placement.is_shard():
            shape[placement.dim] = math.ceil(shape[placement.dim] / mesh.size(i))
    return math.prod(shape)


def gather_unit(fqn: str, units: Units, dp_impl: str) -> str:
    """The gather unit of a parameter: its transformer block; outside the blocks the parameter itself
    (SimpleFSDP gathers per parameter) or FSDP2's root group (embedding, final norm and output together)."""
    return units.unit_of(fqn) or ("root" if dp_impl == "fsdp2" else fqn)


FLOAT8_SCALE_BYTES = 4
"""A float8 weight's scale: one fp32 number."""


def gathered_bytes(layout: Layout, numel: int, float8_numel: int) -> int:
    """Bytes of `numel` gathered elements, `float8_numel` of them weights of float8 layers: those 1 byte
    each when gathered in float8 (`Layout.float8_gather`), the rest in the compute dtype."""
    e = layout.compute_dtype.itemsize
    return numel * e - (float8_numel * (e - 1) if layout.float8_gather else 0)


def float8_shard_bytes(layout: Layout, local_numel: int, weights: int) -> int:
    """What SimpleFSDP keeps for the run to gather `weights` float8 weights of `local_numel` local elements in
    all in float8: each shard's float8 bits (1 byte per element) and each weight's scale
    (`float8_gather.Float8Wire`). FSDP2 (torchao's float8 all-gather) casts each shard when it gathers it."""
    if not (layout.float8_gather and layout.dp_impl == "simple_fsdp"):
        return 0
    return local_numel + weights * FLOAT8_SCALE_BYTES


@dataclass(frozen=True)
class Buffers:
    """Data parallelism's buffers (bytes) of one model or pipeline stage, and the gather units held."""

    held: int = 0
    """Gathered weights held from forward to backward, or kept for the step."""
    in_flight: int = 0
    reduce: int = 0
    transient: int = 0
    """The once-per-step reduction's packing."""
    held_units: frozenset[str] = frozenset()


def gather_buffers(
    numel: dict[str, int],
    float8_numel: dict[str, int],
    largest: int,
    units: Units,
    layout: Layout,
    blocks: Sequence[int],
) -> Buffers:
    """The buffers of a sharded or replicated model (`layout.dp_mode` set) whose gather units hold `numel`
    gathered elements each (`float8_numel` of them float8 layers' weights), in forward order; `largest`: its
    largest parameter's elements; `units`: its blocks (indices `blocks`) and root modules. Replicated, the
    caller has checked that the weights are cast (a compute dtype other than theirs)."""
    size = {u: gathered_bytes(layout, n, float8_numel.get(u, 0)) for u, n in numel.items()}
    # The embedding's (the modules before the blocks) backward needs only the token ids: SimpleFSDP frees
    # its gathered weight after forward.
    kept = [u for u in numel if not under(u, units.before)]
    replicate = layout.dp_mode == "replicate"
    if replicate:  # no gather: a cast of each full weight, kept for backward like an unresharded gather
        held = set(kept)
    elif layout.keep_gathers or (layout.blocks is not None and layout.dp_impl == "fsdp2"):
        held = set(numel)  # kept for the step; FSDP2 under torch's pipeline stage: from the first backward on
    else:
        plan = ReshardPolicy.of(layout.reshard, len(units.blocks))
        prefixes = plan.kept(units) + (() if plan.root else ("root",))
        held = {u for u in kept if under(u, prefixes)}
        if layout.dp_impl == "simple_fsdp":
            # A fully checkpointed block saves only its input: its backward recomputes the gathers too.
            held -= {fqn for fqn, i in zip(units.blocks, blocks) if layout.block_ac(i) == "full"}
    free = sorted((n for u, n in size.items() if u not in held), reverse=True)
    in_flight = sum(free[: 2 if layout.dp_impl == "fsdp2" else 1])
    transient = 0
    if layout.unreduced_grads:  # every gradient, unsharded, until the step's one reduction
        total = sum(numel.values())
        if layout.dp_impl == "fsdp2":  # accumulated in the reduce dtype; reduced unit by unit
            sink_bytes = layout.reduce_dtype.itemsize
            transient = max(numel.values()) * sink_bytes
        else:  # SimpleFSDP's sinks are fp32; one bucket (or one larger gradient) is packed at a time
            from titanlite.parallelisms.data_parallel.step_reduction import (
                REDUCE_BUCKET_BYTES,  # SimpleFSDP's runtime: here
            )

            sink_bytes = 4
            bucket = max(min(REDUCE_BUCKET_BYTES, total * sink_bytes), largest * sink_bytes)
            transient = bucket + (0 if replicate else bucket // layout.shard_ranks)
        reduce_bytes = total * sink_bytes
    else:
        reduce_bytes = 0 if replicate else max(numel.values()) * layout.reduce_dtype.itemsize
    return Buffers(sum(size[u] for u in held), in_flight, reduce_bytes, transient, frozenset(held))


def under(fqn: str, prefixes: Collection[str]) -> bool:
    """Whether `fqn` is one of `prefixes` or inside one."""
    return any(fqn == p or fqn.startswith(p + ".") for p in prefixes)


@dataclass(frozen=True)
class UnitGathers:
    """A parallelized model's gathered elements per gather unit (`gather_unit`), in forward order."""

    numel: dict[str, int]
    float8_numel: dict[str, int]
    """Of those, the elements of float8 layers' weights (`float8.converted_weights`; with `float8.all_gather`)."""
    largest: int
    """The largest parameter's gathered elements."""
    float8_local: int
    """Local (sharded) elements of the float8 layers' weights."""
    float8_weights: int

    @classmethod
    def of(cls, model: nn.Module, units: Units, layout: Layout) -> UnitGathers:
        float8: frozenset[str] = frozenset()
        if layout.float8_gather:
            from titanlite.parallelisms.float8.unit import converted_weights  # torchao: float8 runs only

            float8 = converted_weights(model)
        numel: dict[str, int] = {}
        float8_numel: dict[str, int] = {}
        largest = shard = 0
        for fqn, p in model.named_parameters():
            unit = gather_unit(fqn, units, layout.dp_impl)
            n = gathered_numel(p)
            numel[unit] = numel.get(unit, 0) + n
            largest = max(largest, n)
            if fqn in float8:
                float8_numel[unit] = float8_numel.get(unit, 0) + n
                shard += local_tensor(p).numel()
        return cls(numel, float8_numel, largest, shard, len(float8))

    def gathered(self, layout: Layout) -> dict[str, int]:
        """Bytes each unit's gathers move (`gathered_bytes`): the unsharded side, as the compile report counts."""
        return {u: gathered_bytes(layout, n, self.float8_numel.get(u, 0)) for u, n in self.numel.items()}


def _collective_buffers(model: nn.Module, units: Units, layout: Layout) -> tuple[Buffers, int]:
    """`gather_buffers` of a parallelized model, and SimpleFSDP's float8 shards (`float8_shard_bytes`)."""
    if layout.dp_mode is None:
        return Buffers(), 0
    if layout.dp_mode == "replicate" and layout.compute_dtype == next(model.parameters()).dtype:
        return Buffers(), 0  # no gather and no cast
    g = UnitGathers.of(model, units, layout)
    blocks = layout.blocks if layout.blocks is not None else range(len(units.blocks))
    buffers = gather_buffers(g.numel, g.float8_numel, g.largest, units, layout, blocks)
    return buffers, float8_shard_bytes(layout, g.float8_local, g.float8_weights)


def estimate(model: nn.Module, units: Units, activations: dict[str, int], layout: Layout) -> MemoryEstimate:
    """Memory per GPU of `model` (already parallelized, on any device including meta) under `layout`;
    `units` are its blocks and roots, `activations` the family's estimate (parts and "peak", in bytes)."""
    local = {fqn: local_tensor(p).numel() for fqn, p in model.named_parameters()}
    param_bytes = sum(local_tensor(p).nbytes for p in model.parameters())
    trainable = sum(local_tensor(p).nbytes for p in model.parameters() if p.requires_grad)
    buffers, float8_shards = _collective_buffers(model, units, layout)
    acts = dict(activations)
    peak = acts.pop("peak")
    for key in STAGE_KEYS:
        acts.pop(key, None)
    return MemoryEstimate(
        local_numel=local,
        params=param_bytes,
        grads=trainable,
        optimizer=2 * trainable,
        gather_held=buffers.held,
        gather_in_flight=buffers.in_flight,
        reduce_buffer=buffers.reduce,
        activations=peak,
        activation_parts=acts,
        reduce_transient=buffers.transient,
        held_units=buffers.held_units,
        float8_shards=float8_shards,
    )


STAGE_KEYS = ("held", "boundary", "input_saved")
"""Keys of a family's activation estimate that are not parts of its peak: what a microbatch holds from its
forward to its backward (`held`), the bytes of its hidden state at a stage boundary (`boundary`: what a
pipeline stage hands on and its neighbour receives), and of those the bytes the first block saves of its
input (`input_saved`: the same tensor as the stage's receive buffer)."""


@dataclass(frozen=True)
class StageMemory:
    """One pipeline stage of a rank: its estimate (one microbatch's activations), what one microbatch
    leaves saved for backward (`held`), which the schedule multiplies by the microbatches in flight, and
    the family's stage-boundary sizes (`STAGE_KEYS`)."""

    stage: int
    estimate: MemoryEstimate
    held: int
    boundary: int
    input_saved: int
    first: bool
    last: bool
    in_flight: int
    """Microbatches the schedule keeps in flight on this stage at most (`StageLayout.stage_in_flight`)."""


def stage_runtime(
    first: bool, last: bool, boundary: int, input_saved: int, in_flight: int, microbatches: int
) -> tuple[int, int]:
    """(outputs held, receive buffers) in bytes: what torch.distributed.pipelining's stage holds beyond the
    model's own activations. Each forward's output stays in the stage's forward cache until that
    microbatch's backward (`in_flight` of them; on the last stage the output is the logits, which the
    family's `held` counts). At its first step the stage allocates, for every microbatch of the schedule and
    for the whole run, a buffer that receives its input activations (all stages but the first) and one that
    receives its output's gradients (all but the last); a microbatch in flight runs on its receive buffer,
    which its first block saves (`input_saved`, counted in `held`), so that much is not counted twice."""
    outputs = 0 if last else in_flight * boundary
    activations = 0 if first else microbatches * boundary - in_flight * input_saved
    gradients = 0 if last else microbatches * boundary
    return outputs, activations + gradients


def pipeline_estimate(stages: list[StageMemory], microbatches: int, layout: Layout) -> MemoryEstimate:
    """A pipeline rank's memory: its stages' model state adds up; one gather, one reduce-scatter and one
    packing transient are in flight at a time (the largest), unless the gradients stay unreduced until the
    step's end (`Layout.unreduced_grads`: every stage's add up); each stage holds the activations of the
    microbatches it keeps in flight waiting for backward and their outputs, and the receive buffers of all
    `microbatches` (`stage_runtime`), while one microbatch runs the largest backward peak above what it had
    saved. Each stage's peak in flight is added as if the stages peaked together (exact for 1F1B, and for
    the interleaved schedule with as many microbatches as ranks; an upper bound with more). Gathered
    weights held to backward are per microbatch in flight too (SimpleFSDP gathers a copy per forward),
    unless they are kept for the step (one copy) or FSDP2's (one unsharded copy)."""
    es = [s.estimate for s in stages]
    runtime = {
        s.stage: stage_runtime(s.first, s.last, s.boundary, s.input_saved, s.in_flight, microbatches) for s in stages
    }
    parts = {f"stage {s.stage} saved x {s.in_flight} microbatches": s.in_flight * s.held for s in stages}
    parts |= {
        f"stage {s.stage} outputs x {s.in_flight} microbatches": runtime[s.stage][0] for s in stages if not s.last
    }
    parts["one microbatch's backward peak"] = max(s.estimate.activations - s.held for s in stages)
    return MemoryEstimate(
        local_numel={k: v for e in es for k, v in e.local_numel.items()},
        params=sum(e.params for e in es),
        grads=sum(e.grads for e in es),
        optimizer=sum(e.optimizer for e in es),
        gather_held=sum(held_copies(layout, s.in_flight) * s.estimate.gather_held for s in stages),
        gather_in_flight=max(e.gather_in_flight for e in es),
        reduce_buffer=(sum if layout.unreduced_grads else max)(e.reduce_buffer for e in es),
        activations=sum(parts.values()),
        activation_parts=parts,
        reduce_transient=max(e.reduce_transient for e in es),
        receive_buffers=sum(r[1] for r in runtime.values()),
        held_units=frozenset().union(*(e.held_units for e in es)),
        float8_shards=sum(e.float8_shards for e in es),
    )


def held_copies(layout: Layout, in_flight: int) -> int:
    """Copies of its held gathered weights a pipeline stage keeps with `in_flight` microbatches in flight:
    one per microbatch (each SimpleFSDP forward gathers its own), or one when they are kept for the step
    or are FSDP2's (one unsharded copy per unit)."""
    return 1 if layout.keep_gathers or layout.dp_impl == "fsdp2" else in_flight


_SHORT = {(True, True): "per_step + kept", (False, True): "per_microbatch + kept", (True, False): "per_step",
          (False, False): "per_microbatch"}  # fmt: skip


@dataclass(frozen=True)
class StepChoice:
    """The step policy chosen by `first_fitting`, with the totals it was chosen from."""

    policy: StepPolicy
    candidates: tuple[StepPolicy, ...]
    totals: tuple[int, ...]
    """Per candidate: the largest estimated total over the ranks planned, in bytes (0: not estimated)."""
    capacity: int
    """Bytes of one GPU (or of one rank's share of the host's memory on CPU)."""
    fixed: tuple[str, ...] = ()
    """Why some choices were not the memory estimate's (`step_candidates`)."""

    def describe(self) -> str:
        """The policy and why, for the trainer's `plan:` line and the dry run."""
        why = list(self.fixed)
        if len(self.candidates) > 1 and not any(self.totals):
            why.append("no memory model for this model family: the policy that holds least")
        elif len(self.candidates) > 1:
            chosen = self.candidates.index(self.policy)
            cap, margin = f"{self.capacity / GiB:.4g}", f"{COMFORT_FRACTION:.0%}"
            fits = self.totals[chosen] <= COMFORT_FRACTION * self.capacity
            memory = f"{self.totals[chosen] / GiB:.1f} of {cap} GiB" + ("" if fits else f", none fits in {margin}")
            if chosen and fits:
                over = zip(self.candidates[:chosen], self.totals[:chosen])
                memory += f"; over {margin}: " + ", ".join(
                    f"{_SHORT[c.reduce_once, c.keep_gathers]} {t / GiB:.1f} GiB" for c, t in over
                )
            why.append(f"auto, by the memory estimate: {memory}")
        return f"{self.policy.describe()} ({'; '.join(why)})" if why else self.policy.describe()


def first_fitting(
    candidates: list[StepPolicy], totals: list[int], capacity: int, fixed: Sequence[str] = ()
) -> StepChoice:
    """The first candidate (`step_candidates` order: most collectives saved first) whose total is at most
    `COMFORT_FRACTION` of `capacity`; if none is, the one that holds least. `totals` are per candidate,
    the largest over the ranks (0 for all: no memory model, so the one listed last, which holds least)."""
    if not any(totals):
        pick = candidates[-1]
    else:
        least = candidates[totals.index(min(totals))]
        pick = next((c for c, t in zip(candidates, totals) if t <= COMFORT_FRACTION * capacity), least)
    return StepChoice(pick, tuple(candidates), tuple(totals), capacity, tuple(fixed))
