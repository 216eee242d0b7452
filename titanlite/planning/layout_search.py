"""The layout search: every valid layout of a config on N GPUs of a kind, estimated and ranked.

Every layout of the world (`layout_space`: mesh degrees, context parallelism where the family has it,
activation checkpointing, batch split, pipeline schedule, reshard policy) is estimated for peak memory per
GPU (`layout_memory`, the dry run's estimate applied to parameter shapes) and step time (`step_time`, with
the GPU kind's figures from `gpus`). Layouts within `COMFORT_FRACTION` of the GPU's memory are ranked by
estimated tokens/s per GPU; the fastest of each structure is kept. The meta-device model build comes from
the caller (`param_shapes.MetaBuild`), since building a model is the run's, a layer above. The command,
its confirmation by the dry run and its report are `tools/layout_search.py`; docs/layout_search.md.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from titanlite.config import JobConfig
from titanlite.errors import ConfigError
from titanlite.parallelisms.parallel_dims import reset_to_data_parallel
from titanlite.planning.assumed_vocabulary import build_run_plan
from titanlite.planning.gpus import GpuKind
from titanlite.planning.layout_memory import LayoutMemory, LayoutMemoryModel
from titanlite.planning.layout_space import Degrees, ParallelLayout, least_memory, structures, with_choices
from titanlite.planning.memory import COMFORT_FRACTION, GiB
from titanlite.planning.param_shapes import MetaBuild, ShapeTable
from titanlite.planning.run_plan import RunPlan
from titanlite.planning.step_time import Features, StepTime, StepTimeModel


class Progress(Protocol):
    """Told after each estimate how far a search is (the command prints a line now and then: `SearchProgress`)."""

    def update(self, degrees: Degrees, tried: int, fit: int) -> None: ...


@dataclass
class Estimate:
    layout: ParallelLayout
    plan: RunPlan
    memory: LayoutMemory
    time: StepTime
    given: bool = False
    exact_gib: float | None = None
    """The dry run's peak for this layout, once confirmed."""

    @property
    def gib(self) -> float:
        return self.memory.peak_total / GiB


class LayoutSearch:
    """Estimates of any layout of `cfg` on `world` GPUs of `kind`; `run()` ranks all of them."""

    def __init__(
        self,
        cfg: JobConfig,
        world: int,
        kind: GpuKind,
        build: MetaBuild,
        features: Features | None = None,
        shapes: dict[str, ShapeTable] | None = None,
    ):
        """`build`: the model's meta-device builder (`ShapeTable`); `shapes`: parameter shapes already read, by
        `ShapeTable.key` (shared between searches of one model)."""
        self.cfg, self.world, self.kind = cfg, world, kind
        self.capacity = kind.memory_gib * GiB
        plan, self.notes = _plan_for(cfg, world)
        self.base_plan = plan
        spec, terms = plan.spec, plan.spec.planning
        named = (("step-time", terms.step_cost), ("activation", terms.activation_bytes))
        missing = [what for what, f in named if not f]
        if missing:
            raise ConfigError(
                f"model {spec.name!r} has no {' or '.join(missing)} model (ModelSpec): --plan cannot rank its "
                "layouts" + ("; --dry-run plans the memory of the layout you give" if terms.activation_bytes else "")
            )
        shapes = {} if shapes is None else shapes
        key = ShapeTable.key(cfg, plan)
        if key not in shapes:
            shapes[key] = ShapeTable(cfg, plan, build)
        self.memory_model = LayoutMemoryModel(shapes[key])
        # A float8 run's block matmuls at the GPU's float8 rate (emulated ones at the training dtype's).
        features = features or Features(float8=cfg.float8.enable and not cfg.float8.emulate)
        self._time = {
            e: StepTimeModel(terms.step_cost(plan.model_args, cfg.training.seq_len, e), kind, features) for e in (2, 4)
        }
        self._tokenizer, self._args = plan.tokenizer, plan.model_args

    def build(self, cfg: JobConfig) -> RunPlan:
        return RunPlan.build(cfg, self.world, tokenizer=self._tokenizer, args=self._args)

    def estimate(self, plan: RunPlan, layout: ParallelLayout, given: bool = False) -> Estimate:
        """`layout`, whose run plan is `plan` (`given`: the config's own), estimated under the step policy
        the memory estimate chooses for it."""
        memory = self.memory_model.estimate(plan, int(self.capacity))
        step = self._time[memory.layout.compute_dtype.itemsize].estimate(plan, memory.layout, memory)
        return Estimate(layout, plan, memory, step, given)

    def given(self) -> Estimate | str:
        """The config's own layout, or why it cannot run on this world."""
        try:
            plan = self.build(self.cfg)
        except ConfigError as e:
            return str(e)
        return self.estimate(plan, ParallelLayout.of_config(self.cfg, plan), given=True)

    def global_batch(self) -> int:
        t = self.cfg.training
        if t.global_batch_size > 0:
            return t.global_batch_size
        return self.base_plan.dims.sequences(t.local_batch_size)

    def fits(self, est: Estimate) -> bool:
        return est.memory.peak_total <= self.capacity * COMFORT_FRACTION

    def estimates(self) -> Iterator[Estimate]:
        """Every layout estimated, structure by structure (degrees, batch split, schedule): each AC and
        reshard choice of a structure, or only its least-memory choices when none of those fits."""
        limit = self.capacity * COMFORT_FRACTION
        mesh = None
        for structure in structures(
            self.cfg, self.world, self.kind.gpus_per_node, self.global_batch(), self.build, self._args
        ):
            if structure.layout.degrees != mesh:
                mesh = structure.layout.degrees
                self.memory_model.forget_layouts()
            smallest = [self.estimate(plan, layout) for layout, plan in least_memory(structure, self.build)]
            if smallest and min(e.memory.peak_total for e in smallest) > limit:
                yield from smallest
            elif smallest:
                yield from (self.estimate(plan, layout) for layout, plan in with_choices(structure, self.build))

    def run(self, keep: int, progress: Progress | None = None) -> Ranking:
        """The fastest layout of each of the `keep` fastest structures, the closest layout when none fits,
        and the counts. Only those are kept, not every layout that fits: a search of 100,000 GPUs
        estimates millions, and memory stays the same whatever the world."""
        ranked: list[tuple[float, float, int, Estimate]] = []
        closest: Estimate | None = None
        tried = fit = 0
        best: tuple[float, float, int, Estimate] | None = None  # of the structure being estimated
        for est in self.estimates():
            tried += 1
            if progress is not None:
                progress.update(est.layout.degrees, tried, fit)
            if not self.fits(est):
                if closest is None or est.memory.peak_total < closest.memory.peak_total:
                    closest = est
                continue
            fit += 1
            entry = (est.time.step, est.memory.peak_total, tried, est)
            if best is not None and structure_of(best[3]) != structure_of(est):
                ranked = _keep_fastest([*ranked, best], keep)
                best = None
            if best is None or entry[:3] < best[:3]:
                best = entry
        if best is not None:
            ranked = _keep_fastest([*ranked, best], keep)
        return Ranking([e for *_, e in ranked], closest, tried, fit)


def _keep_fastest(entries: list[tuple[float, float, int, Estimate]], keep: int) -> list:
    """The `keep` fastest entries (less memory, then the earlier enumerated, first among equals)."""
    return sorted(entries, key=lambda entry: entry[:3])[:keep]


def structure_of(est: Estimate) -> ParallelLayout:
    """The layout without its AC and reshard choices: its degrees, batch split and schedule."""
    return dataclasses.replace(est.layout, ac_mode="", ac_option="", reshard="")


@dataclass
class Ranking:
    ranked: list[Estimate]
    """The fastest layout of each of the fastest structures, fastest first (AC and reshard variants of a
    structure above would repeat one row with small differences)."""
    closest: Estimate | None
    """The layout nearest to fitting, when no layout fits."""
    tried: int
    """Layouts estimated."""
    fit: int
    """Layouts that fit."""


def _plan_for(cfg: JobConfig, world: int) -> tuple[RunPlan, list[str]]:
    """A plan of the config's model for `world` ranks: the config's own layout when it is valid there, else
    the same model on plain data parallelism (the search only needs the model and its tokenizer)."""
    try:
        return build_run_plan(cfg, world)
    except ConfigError:
        trial = copy.deepcopy(cfg)
        reset_to_data_parallel(trial.parallelism)
        trial.training.global_batch_size = -1
        return build_run_plan(trial, world)


def planned_config(layout: ParallelLayout, cfg: JobConfig, world: int, kind: GpuKind, global_batch: int) -> JobConfig:
    out = copy.deepcopy(layout.apply(cfg, global_batch))
    out.comm.fake_world_size, out.comm.fake_gpu_memory_gib = world, kind.memory_gib
    out.comm.mode = "default"
    return out
