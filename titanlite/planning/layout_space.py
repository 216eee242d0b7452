"""The layouts a run could use: mesh degrees, activation checkpointing, batch split, pipeline schedule,
reshard policy; which of them are valid; and how one becomes config keys.

    ParallelLayout.of_config(cfg, plan)       the config's own layout
    layout.apply(cfg, global_batch)           the config with this layout's keys set
    structures(cfg, world, ...)               every mesh, batch split and pipeline option the plan accepts
    with_choices(structure, build)            its AC and reshard choices the plan accepts, with their plans

A layout is valid when `RunPlan.build` accepts the config it produces, as the launch's preflight checks
it. The search's own rules: tensor parallelism stays within a node, and the global batch stays the
config's. A new mesh dim searched is a field of `Degrees` (named as in `parallel_dims.DEGREE_KEYS`).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from titanlite.config import JobConfig
from titanlite.errors import ConfigError
from titanlite.models.registry import get_model_spec
from titanlite.parallelisms.parallel_dims import DEGREE_KEYS
from titanlite.parallelisms.pipeline.unit import MULTI_STAGE, SINGLE_STAGE
from titanlite.planning.run_plan import RunPlan

AC_CHOICES: tuple[tuple[str, str], ...] = (
    ("none", "op"),
    ("selective", "op_all_mm"),
    ("selective", "2"),
    ("selective", "op"),
    ("full", "op"),
)
"""(activation_checkpoint.mode, selective_ac_option) pairs searched, least recomputation first."""
RESHARD_CHOICES = ("auto", "always", "never")
"""`auto` is `default` unless the step policy keeps the gathers (when they fit), so `default` is not searched."""
STAGES_PER_RANK = (2, 4)
"""Stages per rank tried for the interleaved schedules."""
SCHEDULES = ("1F1B", *MULTI_STAGE)
"""Schedules searched. GPipe is left out: it has 1F1B's bubble and keeps every microbatch's activations
(1F1B at most the pipeline depth), so it is never the faster or the smaller of the two."""
MIN_CONTEXT_TOKENS = 4096
"""Fewest tokens of a sequence a context-parallel rank holds in a searched layout (seq 8192: cp <= 2;
131072: cp <= 32). A bound on the search's size, not a rule of the run (`RunPlan.build` accepts any cp
whose chunks are whole): every cp degree multiplies the meshes, batch splits and schedules tried. Llama 3
405B on 512 GPUs at seq 8192 (docs/layout_search.md): 2048 (cp <= 4) searched 28,539 layouts in 69 s."""


MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The fields of `Degrees` that are mesh dims (their product is the world), outermost first."""


@dataclass(frozen=True)
class Degrees:
    """The degrees a searched layout sets, by dim name (`parallel_dims.DEGREE_KEYS`), outermost mesh dim first;
    `ep` splits dp_shard x cp again (expert parallelism borrows those ranks), so it is no factor of the world."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return math.prod(getattr(self, name) for name in MESH_DIMS)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        parts = [f"{name} {getattr(self, name)}" for name in MESH_DIMS if getattr(self, name) > 1]
        experts = f" (experts over ep {self.ep})" if self.ep > 1 else ""
        return (" x ".join(parts) or "one rank") + experts


@dataclass(frozen=True)
class ParallelLayout:
    degrees: Degrees
    ac_mode: str
    ac_option: str
    local_batch: int
    """Sequences per data-parallel rank per accumulation batch (one schedule step under PP)."""
    microbatch: int
    """Sequences per pipeline microbatch (= local_batch without PP)."""
    schedule: str = ""
    """Pipeline schedule ("" without PP)."""
    stages_per_rank: int = 1
    reshard: str = "auto"
    split_points: tuple[int, ...] = ()
    """Pipeline stage boundaries (empty: balanced)."""

    @classmethod
    def of_config(cls, cfg: JobConfig, plan: RunPlan) -> ParallelLayout:
        p, t, d = cfg.parallelism, cfg.training, plan.dims
        sp = plan.pipeline
        return cls(
            Degrees(d.pp, d.dp_replicate, d.dp_shard, d.cp, d.tp, d.ep),
            cfg.activation_checkpoint.mode,
            cfg.activation_checkpoint.selective_ac_option,
            t.local_batch_size,
            p.pipeline_parallel_microbatch_size if sp else t.local_batch_size,
            sp.schedule if sp else "",
            sp.stages_per_rank if sp else 1,
            p.fsdp_reshard_after_forward,
            tuple(p.pipeline_parallel_split_points) if sp else (),
        )

    @property
    def ac(self) -> str:
        """AC in one word: none, full, op, op_all_mm, or `every k` (every k-th block)."""
        if self.ac_mode != "selective":
            return self.ac_mode
        return self.ac_option if not self.ac_option.isdigit() else f"every {self.ac_option}"

    def overrides(self) -> dict[str, Any]:
        """`section.key` -> value of every config key this layout sets."""
        out: dict[str, Any] = {f"parallelism.{DEGREE_KEYS[k]}": v for k, v in dataclasses.asdict(self.degrees).items()}
        out |= {
            "activation_checkpoint.mode": self.ac_mode,
            "activation_checkpoint.selective_ac_option": self.ac_option,
            "training.local_batch_size": self.local_batch,
            "parallelism.fsdp_reshard_after_forward": self.reshard,
        }
        if self.degrees.pp > 1:
            out |= {
                "parallelism.pipeline_parallel_schedule": self.schedule,
                "parallelism.pipeline_parallel_stages_per_rank": self.stages_per_rank,
                "parallelism.pipeline_parallel_microbatch_size": self.microbatch,
            }
        out["parallelism.pipeline_parallel_split_points"] = list(self.split_points)
        return out

    def apply(self, cfg: JobConfig, global_batch: int) -> JobConfig:
        """`cfg` with this layout's keys and `global_batch` sequences per step (sections copied, the rest
        shared: treat the result as read-only)."""
        out = copy.copy(cfg)
        sections: dict[str, Any] = {}
        for key, value in self.overrides().items():
            section, name = key.split(".")
            if section not in sections:
                sections[section] = copy.copy(getattr(cfg, section))
                setattr(out, section, sections[section])
            setattr(sections[section], name, value)
        if self.degrees.pp == 1:
            sections["parallelism"].pipeline_parallel_stages_per_rank = -1
            sections["parallelism"].pipeline_parallel_microbatch_size = 1
        sections["training"].global_batch_size = global_batch
        return out

    def describe(self) -> str:
        batch = f"batch {self.local_batch}"
        if self.degrees.pp > 1:
            v = f" x{self.stages_per_rank}" if self.schedule in MULTI_STAGE else ""
            batch += f" in mb {self.microbatch}, {self.schedule}{v}"
        return f"{self.degrees.describe()}, AC {self.ac}, {batch}, reshard {self.reshard}"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def factorisations(world: int) -> Iterator[Degrees]:
    """Every assignment of degrees to `Degrees`' mesh dims (`MESH_DIMS`) whose product is `world`."""
    names = list(MESH_DIMS)

    def rest(n: int, k: int) -> Iterator[tuple[int, ...]]:
        if k == 1:
            yield (n,)
            return
        for d in divisors(n):
            for tail in rest(n // d, k - 1):
                yield (d, *tail)

    for values in rest(world, len(names)):
        yield Degrees(**dict(zip(names, values)))


def context_degrees(cfg: JobConfig, world: int) -> frozenset[int]:
    """The context-parallel degrees searched: 1, and where the model family declares the seam
    (`ModelSpec.parallel.context_parallel`) every divisor c of the world whose 2c chunks cut the sequence evenly
    and leave a rank at least `MIN_CONTEXT_TOKENS` of it."""
    if not get_model_spec(cfg.model.name).parallel.context_parallel:
        return frozenset({1})
    seq = cfg.training.seq_len
    return frozenset({1} | {c for c in divisors(world) if seq % (2 * c) == 0 and seq // c >= MIN_CONTEXT_TOKENS})


def expert_degrees(cfg: JobConfig, args: Any, degrees: Degrees) -> list[int]:
    """The expert-parallel degrees searched on a mesh: 1, and where the model family declares the seam
    (`ModelSpec.parallel.num_experts`) every degree above one that divides both dp_shard x cp (the ranks it
    borrows) and the experts; the run plan refuses those its other rules exclude (pipeline stages, FSDP2)."""
    count = get_model_spec(cfg.model.name).parallel.num_experts
    if count is None or args is None:
        return [1]
    experts = count(args)
    return [1] + [e for e in divisors(degrees.dp_shard * degrees.cp) if e > 1 and experts % e == 0]


def dominated(degrees: Degrees, microbatch: int) -> bool:
    """Whether a data-parallel layout does what this context-parallel one does, for less: when cp and the
    microbatch share a factor g, the layout with cp / g and g times the data-parallel shards (microbatch /
    g) holds the same tokens per rank, shards the parameters over the same ranks and runs the same
    compute, without the K/V gathers and their saved copies. So cp is searched only where a rank's
    microbatch cannot be split into whole sequences over the cp ranks (gcd(cp, microbatch) = 1)."""
    return degrees.cp > 1 and math.gcd(degrees.cp, microbatch) > 1


def pipeline_options(pp: int, local_batch: int) -> Iterator[tuple[str, int, int]]:
    """(schedule, stages per rank, microbatch size) for `pp` pipeline ranks (one empty option without PP)."""
    if pp == 1:
        yield "", 1, local_batch
        return
    for mb in divisors(local_batch):
        for schedule in SCHEDULES:
            for v in (1,) if schedule in SINGLE_STAGE else STAGES_PER_RANK:
                yield schedule, v, mb


@dataclass(frozen=True)
class Structure:
    """A layout without its AC and reshard choices: what decides the batch split and the stages."""

    layout: ParallelLayout
    plan: RunPlan


Build = Callable[[JobConfig], RunPlan]
"""`RunPlan.build` for the search's world, with the tokenizer and model args already resolved."""


def structures(
    cfg: JobConfig, world: int, gpus_per_node: int, global_batch: int, build: Build, args: Any = None
) -> Iterator[Structure]:
    """Every (degrees, local batch, pipeline option) for `world` ranks at `global_batch` sequences per step
    that the run plan accepts without activation checkpointing; `args`, the model's, give the expert-parallel
    degrees searched (`expert_degrees`; None: none)."""
    cps = context_degrees(cfg, world)
    for mesh in factorisations(world):
        if mesh.tp > gpus_per_node or global_batch % mesh.dp or mesh.cp not in cps:
            continue
        for degrees, local in itertools.product(
            [dataclasses.replace(mesh, ep=ep) for ep in expert_degrees(cfg, args, mesh)],
            divisors(global_batch // mesh.dp),
        ):
            for schedule, v, mb in pipeline_options(degrees.pp, local):
                if dominated(degrees, mb):
                    continue
                layout = ParallelLayout(degrees, "none", "op", local, mb, schedule, v, "auto")
                plan = _plan(build, layout.apply(cfg, global_batch))
                if plan is not None:
                    yield Structure(layout, plan)


def _plan(build: Build, cfg: JobConfig) -> RunPlan | None:
    """The run plan of `cfg`, or None where a launch would refuse it (one of the plan's rules)."""
    try:
        return build(cfg)
    except ConfigError:
        return None


def with_choices(
    structure: Structure, build: Build, ac: tuple[tuple[str, str], ...] = AC_CHOICES
) -> Iterator[tuple[ParallelLayout, RunPlan]]:
    """The structure's layout under every AC (of `ac`) and reshard choice that the run plan accepts (the
    compile rules refuse some AC choices: `compile.check_compile`), each with its plan."""
    cfg, global_batch = structure.plan.cfg, structure.plan.global_batch
    for (mode, option), reshard in itertools.product(ac, RESHARD_CHOICES):
        layout = dataclasses.replace(structure.layout, ac_mode=mode, ac_option=option, reshard=reshard)
        plan = _plan(build, layout.apply(cfg, global_batch))
        if plan is not None:
            yield layout, plan


def least_memory(structure: Structure, build: Build) -> list[tuple[ParallelLayout, RunPlan]]:
    """The structure's layouts that keep the fewest activations (the most recomputation the run plan
    accepts): if none of them fits, no choice of the structure does."""
    for choice in reversed(AC_CHOICES):
        if out := list(with_choices(structure, build, (choice,))):
            return out
    return []
