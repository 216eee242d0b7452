"""The dry run's memory estimate for many layouts at once, from parameter shapes instead of a model build.

A layout search asks for thousands of layouts what the dry run asks of one parallelized model
(`titanlite/planning/memory.py`), so the shapes are read once per tensor-parallel degree (`ShapeTable`,
`param_shapes.py`: the model built on the meta device with TP only) and data-parallel sharding is applied
arithmetically: dim 0 of the TP-local shape over dp_shard x cp, rank 0 holding the ceiling. Everything
else follows the memory estimate's rules through its own functions (`gather_buffers`, `pipeline_estimate`,
`first_fitting`, the family's activation model). Tests hold it equal to the dry run on the layouts they
build; docs/layout_search.md describes the search that reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from titanlite.parallelisms.layout import Layout
from titanlite.parallelisms.units import Units
from titanlite.planning.memory import (
    Buffers,
    MemoryEstimate,
    StageMemory,
    StepChoice,
    first_fitting,
    float8_shard_bytes,
    gather_buffers,
    pipeline_estimate,
    stage_runtime,
    under,
)
from titanlite.planning.param_shapes import ShapeTable
from titanlite.planning.run_plan import RunPlan


@dataclass(frozen=True)
class StageUnits:
    """One pipeline stage (the whole model without PP): its gather units and what memory they take."""

    stage: int
    blocks: range
    first: bool
    last: bool
    gathered: dict[str, int]
    """Gather unit -> elements after the data-parallel gather (TP-local), in forward order."""
    float8: dict[str, int]
    """Gather unit -> those of its gathered elements that are float8 layers' weights (`ParamShape.float8`)."""
    tensors: dict[str, int]
    """Gather unit -> its parameters (one collective each where nothing buckets them)."""
    block_units: tuple[str, ...]
    """The units that are blocks, in order (one per block of `blocks`)."""
    held: frozenset[str]
    """Units whose gathered weights live from forward to backward (not gathered again in backward)."""
    before: frozenset[str]
    """Units before the blocks (the embedding): their backward needs no weights, so no re-gather."""
    memory: MemoryEstimate
    held_activations: int
    boundary: int
    """The family's `boundary` and `input_saved` (`memory.STAGE_KEYS`)."""
    input_saved: int

    @cached_property
    def numel(self) -> tuple[int, ...]:
        """Gathered elements per unit, in forward order."""
        return tuple(self.gathered.values())

    @cached_property
    def float8_numel(self) -> tuple[int, ...]:
        """Gathered elements of float8 layers' weights per unit, in forward order."""
        return tuple(self.float8.get(u, 0) for u in self.gathered)

    @cached_property
    def n_tensors(self) -> tuple[int, ...]:
        return tuple(self.tensors[u] for u in self.gathered)

    @cached_property
    def regathered(self) -> tuple[bool, ...]:
        """Per unit: gathered again for backward (freed after forward, and its backward needs weights)."""
        return tuple(u not in self.held and u not in self.before for u in self.gathered)

    @cached_property
    def block_positions(self) -> tuple[int, ...]:
        """The position among the units of each block's unit, in block order."""
        units = list(self.gathered)
        return tuple(units.index(u) for u in self.block_units)


@dataclass
class RankMemory:
    """One pipeline rank (the only one without PP): its stages and the microbatches in flight on it."""

    stages: list[StageUnits]
    layout: Layout
    """The whole model's layout (`memory.pipeline_estimate` reads its step policy)."""
    in_flight: tuple[int, ...] = (1,)
    """Per stage, the microbatches the schedule keeps in flight at most (`StageLayout.stage_in_flight`)."""
    microbatches: int = 1
    pipelined: bool = False

    @cached_property
    def memory(self) -> MemoryEstimate:
        """The estimate as the dry run reports it (`memory.pipeline_estimate` under PP)."""
        if not self.pipelined:
            return self.stages[0].memory
        stages = [
            StageMemory(u.stage, u.memory, u.held_activations, u.boundary, u.input_saved, u.first, u.last, k)
            for u, k in zip(self.stages, self.in_flight)
        ]
        return pipeline_estimate(stages, self.microbatches, self.layout)

    @cached_property
    def total(self) -> int:
        """`memory.total` without building the estimate's parts (the search asks for thousands)."""
        if not self.pipelined:
            return self.stages[0].memory.total
        ms, lay = [u.memory for u in self.stages], self.layout
        one_copy = lay.keep_gathers or lay.dp_impl == "fsdp2"
        runtime = [
            stage_runtime(u.first, u.last, u.boundary, u.input_saved, k, self.microbatches)
            for u, k in zip(self.stages, self.in_flight)
        ]
        return (
            sum(outputs + buffers for outputs, buffers in runtime)
            + sum(m.params + m.grads + m.optimizer for m in ms)
            + sum((1 if one_copy else k) * m.gather_held for m, k in zip(ms, self.in_flight))
            + sum(m.float8_shards for m in ms)
            + max(m.gather_in_flight for m in ms)
            + (sum if lay.unreduced_grads else max)(m.reduce_buffer for m in ms)
            + max(m.reduce_transient for m in ms)
            + sum(k * u.held_activations for u, k in zip(self.stages, self.in_flight))
            + max(u.memory.activations - u.held_activations for u in self.stages)
        )

    @property
    def params(self) -> int:
        return sum(u.memory.params for u in self.stages)


@dataclass
class LayoutMemory:
    ranks: list[RankMemory]
    step_choice: StepChoice | None = None
    """The step policy the memory estimate chose for this layout (`memory.first_fitting`)."""

    @property
    def layout(self) -> Layout:
        """The whole model's layout, step policy included."""
        return self.ranks[0].layout

    @cached_property
    def peak_rank(self) -> int:
        return max(range(len(self.ranks)), key=lambda r: self.ranks[r].total)

    @property
    def peak_total(self) -> int:
        return self.ranks[self.peak_rank].total

    @property
    def peak(self) -> MemoryEstimate:
        return self.ranks[self.peak_rank].memory


class LayoutMemoryModel:
    """Memory per GPU of any layout of one model and config, from a `ShapeTable`."""

    def __init__(self, shapes: ShapeTable):
        self.shapes = shapes
        self.spec, self.args = shapes.plan.spec, shapes.plan.model_args
        self._stage_params: dict[tuple, _StageParams] = {}
        self._activations: dict[Layout, dict[str, int]] = {}
        self._stages: dict[tuple, StageUnits] = {}
        self._stage_layouts: dict[tuple, Layout] = {}

    def forget_layouts(self) -> None:
        """Drop what is kept per layout (the parameter tables stay): a search calls it between meshes,
        whose layouts share little, so that its memory does not grow with the world."""
        self._activations.clear()
        self._stages.clear()
        self._stage_layouts.clear()

    def activations(self, layout: Layout) -> dict[str, int]:
        if layout not in self._activations:
            assert self.spec.planning.activation_bytes is not None
            self._activations[layout] = self.spec.planning.activation_bytes(self.args, layout)
        return self._activations[layout]

    def _params(
        self, tp: int, shard: int, dp_impl: str, blocks: range, first: bool, last: bool, ep: int = 1
    ) -> _StageParams:
        """The stage's parameters sharded over `shard` data-parallel ranks (the experts over ep x efsdp: the
        same elements per rank, gathered over efsdp alone)."""
        key = (tp, shard, dp_impl, blocks.start, blocks.stop, first, last, ep)
        if key not in self._stage_params:
            nbytes = trainable = float8_local = float8_weights = 0
            units: dict[str, int] = {}
            float8: dict[str, int] = {}
            tensors: dict[str, int] = {}
            largest = 0
            block_units, before, after = [], set(), set()
            for p in self.shapes.params(tp):
                if p.unit:
                    if p.block not in blocks:
                        continue
                    unit = p.unit
                    if unit not in units:
                        block_units.append(unit)
                elif (p.before and not first) or (not p.before and not last):
                    continue
                else:
                    module = p.fqn.split(".")[0]
                    (before if p.before else after).add(module)
                    unit = "root" if dp_impl == "fsdp2" else p.fqn
                n = p.local_numel(shard) * p.itemsize
                nbytes += n
                trainable += n if p.trainable else 0
                gathered = p.gathered_numel // ep if p.expert else p.gathered_numel
                units[unit] = units.get(unit, 0) + gathered
                tensors[unit] = tensors.get(unit, 0) + 1
                largest = max(largest, gathered)
                if p.float8:
                    float8[unit] = float8.get(unit, 0) + gathered
                    float8_local += p.local_numel(shard)
                    float8_weights += 1
            self._stage_params[key] = _StageParams(
                nbytes,
                trainable,
                units,
                tensors,
                largest,
                Units(dict.fromkeys(block_units), tuple(before), tuple(after)),  # type: ignore[arg-type]
                float8,
                float8_local,
                float8_weights,
            )
        return self._stage_params[key]

    def stage(self, layout: Layout, plan: RunPlan, stage: int, blocks: range, first: bool, last: bool) -> StageUnits:
        dims = plan.dims
        shard = dims.shard_degree if layout.dp_mode in ("fully_shard", "hybrid_shard") else 1
        key = (layout, shard, stage, blocks.start, blocks.stop, first, last)
        if key not in self._stages:
            self._stages[key] = self._stage(layout, dims.tp, shard, stage, blocks, first, last)
        return self._stages[key]

    def _stage(self, layout: Layout, tp: int, shard: int, stage: int, blocks: range, first: bool, last: bool):
        params = self._params(tp, shard, layout.dp_impl, blocks, first, last, layout.ep)
        b = self._buffers(layout, params, blocks)
        acts = dict(self.activations(layout))
        peak, held_acts = acts.pop("peak"), acts.pop("held", 0)
        boundary, input_saved = acts.pop("boundary", 0), acts.pop("input_saved", 0)
        t = params.trainable
        float8_shards = float8_shard_bytes(layout, params.float8_local, params.float8_weights) if layout.dp_mode else 0
        memory = MemoryEstimate(
            {},
            params.nbytes,
            t,
            2 * t,
            b.held,
            b.in_flight,
            b.reduce,
            peak,
            acts,
            b.transient,
            float8_shards=float8_shards,
        )
        before = frozenset(u for u in params.units if under(u, params.model_units.before))
        block_units = tuple(params.model_units.blocks)
        return StageUnits(
            stage,
            blocks,
            first,
            last,
            params.units,
            params.float8,
            params.tensors,
            block_units,
            b.held_units,
            before,
            memory,
            held_acts,
            boundary,
            input_saved,
        )

    @staticmethod
    def _buffers(layout: Layout, params: _StageParams, blocks: range) -> Buffers:
        """`memory.gather_buffers` from the units' gathered sizes; without data parallelism, or replicated
        in the weights' own dtype (fp32), none, and every unit counts as held (nothing is gathered again)."""
        units = params.units
        if layout.dp_mode is None or (layout.dp_mode == "replicate" and layout.compute_dtype == torch.float32):
            return Buffers(held_units=frozenset(units))
        return gather_buffers(units, params.float8, params.largest, params.model_units, layout, blocks)

    def estimate(self, plan: RunPlan, capacity: int) -> LayoutMemory:
        """Every pipeline rank's memory (the one rank without PP) for the run `plan` describes, under the
        step policy the memory estimate chooses for a GPU of `capacity` bytes (`build.choose_step_policy`:
        the first of the config's candidates whose largest rank fits comfortably)."""
        candidates, fixed = plan.step_candidates, plan.step_fixed
        if len(candidates) == 1:
            memory = self.of_layout(plan, plan.layout(candidates[0]))
            memory.step_choice = first_fitting(candidates, [0], capacity, fixed)
            return memory
        estimates = [self.of_layout(plan, plan.layout(c)) for c in candidates]
        choice = first_fitting(candidates, [e.peak_total for e in estimates], capacity, fixed)
        memory = estimates[candidates.index(choice.policy)]
        memory.step_choice = choice
        return memory

    def of_layout(self, plan: RunPlan, layout: Layout) -> LayoutMemory:
        """Every pipeline rank's memory for `layout` (its step policy already set)."""
        sp = plan.pipeline
        n_blocks = self.args.n_layers
        if sp is None:
            return LayoutMemory([RankMemory([self.stage(layout, plan, 0, range(n_blocks), True, True)], layout)])
        microbatch = plan.cfg.parallelism.pipeline_parallel_microbatch_size
        ranks = []
        for r in range(sp.degree):
            stages = []
            for s in sp.stages_of(r):
                last = s == sp.n_stages - 1
                key = (layout, sp.starts, s, microbatch)
                if key not in self._stage_layouts:
                    self._stage_layouts[key] = layout.stage(sp.blocks(s), last, microbatch)
                stage_layout = self._stage_layouts[key]
                stages.append(self.stage(stage_layout, plan, s, sp.blocks(s), s == 0, last))
            ranks.append(RankMemory(stages, layout, sp.stage_in_flight(r), sp.microbatches, pipelined=True))
        return LayoutMemory(ranks)


@dataclass(frozen=True)
class _StageParams:
    nbytes: int
    trainable: int
    units: dict[str, int]
    """Gather unit -> gathered elements, in forward order."""
    tensors: dict[str, int]
    """Gather unit -> parameters in it."""
    largest: int
    """Gathered elements of the stage's largest parameter."""
    model_units: Units
    """The stage's blocks (FQN keys only) and root modules, as `Units` names them."""
    float8: dict[str, int]
    """Gather unit -> gathered elements of its float8 layers' weights."""
    float8_local: int
    """Local (sharded) elements of the stage's float8 layers' weights."""
    float8_weights: int
