"""Layout search: which parallel layout should this config use on N GPUs of a kind? One CPU process.

    ./run_train.sh --config FILE --plan [--comm.fake_world_size N] [--layout_search.gpu h100|h200|a100|b200|...]
                                        [--comm.fake_gpu_memory_gib GIB: instead of the kind's memory]
    python -m titanlite.tools.layout_search --config FILE [--section.key value ...]

The search itself is `titanlite/planning/layout_search.py`. This command runs it with the dry run's model
builder, plans the `layout_search.confirm` fastest layouts and the config's own (the `given` row) with the
dry run itself (the `exact` column), prints the ranked table and writes the fastest that fits as a complete
config to `<dump_folder>/plan.toml`, which `--dry-run` accepts as is (docs/layout_search.md).

Exit codes: 0 = a layout fits and plan.toml is written; 1 = no layout fits (one line naming the closest
and what it needs); 2 = bad input (config, GPU kind, a world size no layout divides).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any

from titanlite.config import DEFAULT_CONFIG, JobConfig, load_config, load_toml, parse_overrides
from titanlite.errors import ConfigError, exit_now, run_tool
from titanlite.launcher.preflight import check_writable
from titanlite.parallelisms.parallelize import PARALLELISMS
from titanlite.planning.gpus import GpuKind, gpu_kind
from titanlite.planning.layout_search import Estimate, LayoutSearch, Ranking, planned_config
from titanlite.planning.memory import COMFORT_FRACTION, GiB
from titanlite.tools.dry_run import dry_run, meta_model, world_size_of
from titanlite.tools.search_progress import SearchProgress

PLAN_NAME = "plan.toml"


def confirm(est: Estimate, cfg: JobConfig, world: int, kind: GpuKind, global_batch: int) -> JobConfig:
    """Plan `est` with the dry run itself; sets `est.exact_gib` and returns the layout's config."""
    out = planned_config(est.layout, cfg, world, kind, global_batch)
    est.exact_gib = dry_run(out).peak_total / GiB
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
    search = LayoutSearch(cfg, world, kind, meta_model)
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
