"""Layout search: which parallel layout should this config use on N GPUs of a kind? One CPU process.

    ./run_train.sh --config FILE --plan [--comm.fake_world_size N] [--layout_search.gpu h100|h200|a100|b200|...]
                                        [--comm.fake_gpu_memory_gib GIB: instead of the kind's memory]
    python -m titanlite.tools.layout_search --config FILE [--section.key value ...]

Every valid layout for the world (`titanlite/planning/layout_space.py`: mesh degrees, context parallelism where
the model family has it, activation checkpointing, batch split, pipeline schedule, reshard policy) is
estimated for peak memory per GPU (the dry run's model applied to parameter shapes:
`titanlite/planning/layout_memory.py`) and step time (`titanlite/planning/step_time.py`, with the GPU
kind's figures from `titanlite/planning/gpus.py`). Layouts within
`COMFORT_FRACTION` of the GPU's memory are ranked by estimated tokens/s per GPU. The config's own layout is
estimated first (the `given` row); the `layout_search.confirm` fastest and the given one are then planned by the
dry run itself (the `exact` column), and the fastest that fits is written as a complete config to
`<dump_folder>/plan.toml`, which `--dry-run` accepts as is.

Exit codes: 0 = a layout fits and plan.toml is written; 1 = no layout fits (one line naming the closest
and what it needs); 2 = bad input (config, GPU kind, a world size no layout divides).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from titanlite.config import DEFAULT_CONFIG, JobConfig, load_config, load_toml, parse_overrides
from titanlite.errors import ConfigError, exit_now, run_tool
from titanlite.launcher.preflight import check_writable
from titanlite.parallelisms.parallel_dims import reset_to_data_parallel
from titanlite.parallelisms.parallelize import PARALLELISMS
from titanlite.planning.gpus import GpuKind, gpu_kind
from titanlite.planning.layout_memory import LayoutMemory, LayoutMemoryModel, ShapeTable
from titanlite.planning.layout_space import ParallelLayout, least_memory, structures, with_choices
from titanlite.planning.memory import COMFORT_FRACTION, GiB
from titanlite.planning.run_plan import RunPlan
from titanlite.planning.step_time import Features, StepTime, StepTimeModel
from titanlite.tools.dry_run import build_run_plan, dry_run, fake_process_group, world_size_of
from titanlite.tools.search_progress import SearchProgress

PLAN_NAME = "plan.toml"


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
        features: Features | None = None,
        shapes: dict[str, ShapeTable] | None = None,
    ):
        """`shapes`: parameter shapes already read, by `ShapeTable.key` (shared between searches of one model)."""
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
            shapes[key] = ShapeTable(cfg, plan, fake_process_group)
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
        the memory plan chooses for it."""
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
        for structure in structures(self.cfg, self.world, self.kind.gpus_per_node, self.global_batch(), self.build):
            if structure.layout.degrees != mesh:
                mesh = structure.layout.degrees
                self.memory_model.forget_layouts()
            smallest = [self.estimate(plan, layout) for layout, plan in least_memory(structure, self.build)]
            if smallest and min(e.memory.peak_total for e in smallest) > limit:
                yield from smallest
            elif smallest:
                yield from (self.estimate(plan, layout) for layout, plan in with_choices(structure, self.build))

    def run(self, keep: int, progress: SearchProgress | None = None) -> Ranking:
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


def confirm(est: Estimate, cfg: JobConfig, world: int, kind: GpuKind, global_batch: int) -> JobConfig:
    """Plan `est` with the dry run itself; sets `est.exact_gib` and returns the layout's config."""
    out = planned_config(est.layout, cfg, world, kind, global_batch)
    est.exact_gib = dry_run(out).peak_total / GiB
    return out


def planned_config(layout: ParallelLayout, cfg: JobConfig, world: int, kind: GpuKind, global_batch: int) -> JobConfig:
    out = copy.deepcopy(layout.apply(cfg, global_batch))
    out.comm.fake_world_size, out.comm.fake_gpu_memory_gib = world, kind.memory_gib
    out.comm.mode = "default"
    return out


def why_slower(est: Estimate, best: Estimate) -> str:
    """One line: how much slower than the best and the part of the step that costs it most."""
    a, b = est.time, best.time
    parts = {"compute": a.compute - b.compute, "AC recompute": a.recompute - b.recompute}
    for unit in PARALLELISMS:
        if unit.step_time is not None:
            parts[unit.comm_words] = a.comm.get(unit.name, 0.0) - b.comm.get(unit.name, 0.0)
    parts |= {
        "exposed dp collectives": a.dp_comm - b.dp_comm,
        "pipeline send/recv": a.send_recv - b.send_recv,
        "pipeline bubble": a.bubble - b.bubble,
        "optimizer": a.optimizer - b.optimizer,
    }
    ratio = b.tokens_per_s / a.tokens_per_s - 1
    if ratio <= 1e-9:
        return "as fast as the best"
    noise = 0.005 * b.step
    costs = sorted(((d, n) for n, d in parts.items() if d > noise), reverse=True)[:2]
    gap = a.step - b.step
    if sum(d for d, _ in costs) > gap + noise:  # what the layout saves elsewhere, so that the parts add up
        costs.append(min((d, n) for n, d in parts.items()))
    what = ", ".join(f"{n} {'+' if d > 0 else ''}{duration(d)}" for d, n in costs) or "small differences everywhere"
    return f"{ratio:.1%} slower per step (+{duration(gap)}): {what}"


def duration(seconds: float) -> str:
    """Seconds in the unit that shows them: a small model's step takes milliseconds, which `0.00 s` hides."""
    return f"{seconds:.2f} s" if abs(seconds) >= 0.1 else f"{seconds * 1e3:.2g} ms"


def _row(rank: str, e: Estimate) -> list[str]:
    exact = f"{e.exact_gib:.1f}" if e.exact_gib is not None else ""
    t = e.time
    return [
        rank,
        e.layout.describe(),
        f"{e.gib:.1f}",
        exact,
        f"{t.tokens_per_s:,.0f}",
        f"{t.mfu:.1f}",
        f"{100 * t.bubble_fraction:.1f}",
        f"{t.exposed_comm:.2f}",
        f"{t.step:.2f}",
    ]


HEADER = ["#", "layout", "GiB", "exact", "tok/s/GPU", "MFU %", "bubble %", "exposed comm s", "step s"]


def format_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    lines = []
    for r in [HEADER, *rows]:
        lines.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)


def toml_text(cfg: JobConfig, header: str) -> str:
    """`cfg` as TOML: every key that differs from the defaults, plus the layout's keys (always written)."""
    default, current = JobConfig().to_dict(), cfg.to_dict()
    forced = {"parallelism", "activation_checkpoint"}
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    for section, body in current.items():
        keys = {k: v for k, v in body.items() if k != "config_file" and (section in forced or v != default[section][k])}
        if section == "training":
            keys.setdefault("local_batch_size", body["local_batch_size"])
            keys.setdefault("global_batch_size", body["global_batch_size"])
        if not keys:
            continue
        lines += ["", f"[{section}]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in keys.items()]
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {v!r}")


MEMORY_KEY = "comm.fake_gpu_memory_gib"


def memory_given(argv: list[str], cfg: JobConfig) -> bool:
    """Whether the config file or the command line sets `comm.fake_gpu_memory_gib`: the search then plans
    for that memory per GPU instead of the GPU kind's (a part of it held back, a GPU of another size)."""
    if cfg.job.config_file and "fake_gpu_memory_gib" in load_toml(cfg.job.config_file).get("comm", {}):
        return True
    rest = list(argv)
    for i, arg in enumerate(rest):
        if arg in ("--config", "--job.config_file"):
            del rest[i : i + 2]
            break
        if arg.startswith(("--config=", "--job.config_file=")):
            del rest[i]
            break
    return any(key == MEMORY_KEY for key, _ in parse_overrides(rest))


def kind_of(argv: list[str], cfg: JobConfig) -> GpuKind:
    """`layout_search.gpu`'s kind, with `comm.fake_gpu_memory_gib`'s memory where the config or command line sets it."""
    kind = gpu_kind(cfg.layout_search.gpu)
    if memory_given(argv, cfg):
        kind = dataclasses.replace(kind, memory_gib=cfg.comm.fake_gpu_memory_gib)
    return kind


def main(argv: list[str]) -> int:
    started = time.perf_counter()
    cfg = load_config(argv, default_config=DEFAULT_CONFIG)
    world = world_size_of(cfg)
    kind = kind_of(argv, cfg)
    check_writable("job.dump_folder", cfg.job.dump_folder)  # where plan.toml goes: before the search, not after
    search = LayoutSearch(cfg, world, kind)
    given = search.given()
    global_batch = search.global_batch()
    result = search.run(max(cfg.layout_search.top, cfg.layout_search.confirm), SearchProgress(world))
    ranked, closest = result.ranked, result.closest
    if not ranked:
        if closest is None:
            raise ConfigError(
                f"no valid layout of {cfg.model.flavor} on {world} GPUs at a global batch of {global_batch} "
                "sequences (degrees must divide the world, the model's heads and the global batch)"
            )
        print(
            f"titanlite: error: no layout fits {world} x {kind.name}: closest {closest.layout.describe()} needs "
            f"{closest.gib:.1f} GiB per GPU of {kind.memory_gib:g} (within {COMFORT_FRACTION:.0%}: "
            f"{kind.memory_gib * COMFORT_FRACTION:.1f})",
            file=sys.stderr,
            flush=True,
        )
        return 1
    best = None
    for est in ranked[: cfg.layout_search.confirm]:
        planned = confirm(est, cfg, world, kind, global_batch)
        if best is None and est.exact_gib is not None and est.exact_gib * GiB <= search.capacity * COMFORT_FRACTION:
            best, best_cfg = est, planned
    if isinstance(given, Estimate):
        confirm(given, cfg, world, kind, global_batch)
    if best is None:
        raise RuntimeError("the dry run rejected every confirmed layout the estimate accepted")
    elapsed = time.perf_counter() - started
    out = os.path.join(cfg.job.dump_folder, PLAN_NAME)  # the folder is made (check_writable)
    header = (
        f"Written by ./run_train.sh --config {cfg.job.config_file or DEFAULT_CONFIG} --plan: the fastest of "
        f"{result.fit:,} layouts that fit {world} x {kind.name} (estimated)\n"
        f"{best.layout.describe()}\n"
        f"estimated {best.time.tokens_per_s:,.0f} tokens/s per GPU, MFU {best.time.mfu:.1f}%, "
        f"{best.exact_gib:.1f} GiB per GPU (dry run)"
    )
    with open(out, "w") as f:
        f.write(toml_text(best_cfg, header))
    print(report(cfg, world, kind, given, result, best, out, elapsed, search.notes), flush=True)
    return 0


def report(cfg, world, kind, given, result: Ranking, best, out, elapsed, notes) -> str:
    lines = [
        f"layout search: {cfg.model.name} {cfg.model.flavor} on {world} x {kind.name} ({kind.description}, "
        f"{kind.memory_gib:g} GiB), seq {cfg.training.seq_len}",
        f"  {result.tried:,} layouts estimated, {result.fit:,} fit within {COMFORT_FRACTION:.0%} of memory; the "
        "fastest of each mesh and batch split below; GiB = estimated peak per GPU, exact = the dry run's"
        + ("; MFU % of the bf16 peak (float8 matmuls included)" if cfg.float8.enable else ""),
        *(f"  note: {n}" for n in notes),
        "",
    ]
    rows = []
    if isinstance(given, Estimate):
        rows.append(_row("given", given))
    top = result.ranked[: cfg.layout_search.top]
    rows += [_row(str(i + 1), e) for i, e in enumerate(top)]
    lines.append(format_table(rows))
    lines.append("")
    if isinstance(given, Estimate):
        fit = given.exact_gib is not None and given.exact_gib * GiB <= kind.memory_gib * GiB * COMFORT_FRACTION
        lines.append(f"  given: {why_slower(given, best)}" + ("" if fit else "; does not fit"))
    else:
        lines.append(f"  given: not valid on {world} GPUs ({given})")
    for i, e in enumerate(top[1:], start=2):
        lines.append(f"  {i}: {why_slower(e, best)}")
    lines += ["", f"best: {best.layout.describe()}", f"wrote {out} (check it: ./run_train.sh --config {out} --dry-run)"]
    lines.append(f"searched in {elapsed:.1f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    exit_now(run_tool(main))
