"""The compile report: the collectives one training step issues on each mesh dim (`dp`, `cp`, `tp`),
before and after the graph passes, and how many of them compute overlaps.

Collected from the graphs AOTAutograd hands the compilers (`collectives.graph_collectives`) and multiplied
out per compile unit (each block under per-block compile, else the whole model); a fully checkpointed
block's forward collectives count again as backward ones (its recompute). Names: `all_gather` (forward),
`reduce_scatter` and `all_reduce` (backward); anything else carries its phase (`backward_all_gather`: the
re-gathers of reshard-after-forward; `forward_reduce_scatter`: tensor parallelism's row-wise outputs).
Context parallelism's collectives count under `cp`, told from data parallelism's by what they move where
they share its group (`collectives.Collective.activation`). Logged, and written on rank 0 to
`<dump_folder>/compile_report.json` once every unit's forward and backward are compiled (docs/compile.md).
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from titanlite.compile.collectives import Collective

logger = logging.getLogger("titanlite")

REPORT_NAME = "compile_report.json"
"""The report's file name in the dump folder."""

_USUAL = {("forward", "all_gather"), ("backward", "reduce_scatter"), ("backward", "all_reduce")}


@dataclass
class Unit:
    """One compiled region; `recompute_forward`: an eager checkpoint runs its forward graph again."""

    name: str
    recompute_forward: bool
    graphs: dict[str, tuple[list[Collective], list[Collective]]] = field(default_factory=dict)
    """phase ("forward"/"backward") -> collectives (before passes, after passes)."""
    copies: int = 1
    """How many blocks run this unit's graphs (identical blocks share one compiled unit)."""


class CompileReport:
    """Per-step collective counts of the compiled units, logged and written once all are compiled.

    `labels` maps process-group names to mesh-dim labels (`dp`, `tp`); `eager_params` is the number of
    SimpleFSDP parameters outside every compiled unit (each still costs its own eager all-gather and
    reduce-scatter per step, which the counts here do not include). `routing_to_sinks` says whether the
    model's gathers now route their gradients to sinks (`SimpleFSDPState.unreduced`), read as each graph
    is recorded. `compile_seconds` is the time spent in the compile backends (AOTAutograd, partitioning,
    graph passes, codegen; lazily compiled backwards included), not Dynamo's bytecode tracing.
    """

    def __init__(
        self,
        labels: dict[str, str],
        settings: dict[str, Any],
        eager_params: int,
        path: str | None,
        cost_model: dict[str, float] | None,
        routing_to_sinks: Callable[[], bool] = lambda: False,
    ):
        self.labels, self.settings, self.eager_params = labels, settings, eager_params
        self.path, self.cost_model = path, cost_model
        self.routing_to_sinks = routing_to_sinks
        self.units: list[Unit] = []
        self.compile_seconds = 0.0
        self.written = False
        self.reduced_outside = False
        """Traced inside `step_reduction.unreduced` (gradient_reduction per_step with several backwards per
        step): the backward graphs hold no dp reductions; the gradients are reduced once per step after
        them, one collective per ~64 MiB bucket, which the counts here do not include."""

    def add_unit(self, name: str, recompute_forward: bool) -> Unit:
        unit = Unit(name, recompute_forward)
        self.units.append(unit)
        return unit

    def record(self, unit: Unit, phase: str, before: list[Collective], after: list[Collective]) -> None:
        unit.graphs[phase] = (before, after)
        self.reduced_outside |= self.routing_to_sinks()

    def compiled(self, seconds: float) -> None:
        """Account one finished compile; once every unit has its forward and backward, log and write."""
        self.compile_seconds += seconds
        if not self.written and self.complete():
            self.written = True
            self.finish()

    def complete(self) -> bool:
        return bool(self.units) and all({"forward", "backward"} <= set(u.graphs) for u in self.units)

    def _per_step(self, which: int) -> list[tuple[str, Collective]]:
        """(phase, collective) for one step; `which` 0 = before the passes, 1 = after."""
        out = []
        for unit in self.units:
            for phase, graphs in unit.graphs.items():
                out += [(phase, c) for c in graphs[which]] * unit.copies
            if unit.recompute_forward and "forward" in unit.graphs:
                out += [("backward", c) for c in unit.graphs["forward"][which]] * unit.copies
        return out

    def counts(self) -> dict[str, dict[str, dict[str, int]]]:
        """{label: {name: {"before": n, "after": m}}} per step."""
        table: dict[str, dict[str, dict[str, int]]] = {}
        for which, key in ((0, "before"), (1, "after")):
            for (label, name), n in Counter(self._key(p, c) for p, c in self._per_step(which)).items():
                table.setdefault(label, {}).setdefault(name, {"before": 0, "after": 0})[key] = n
        return table

    def _label(self, c: Collective) -> str:
        label = self.labels.get(c.group_name, f"group_{c.group_name}")
        return "cp" if label == "dp" and c.activation else label  # (module docstring)

    def _key(self, phase: str, c: Collective) -> tuple[str, str]:
        return self._label(c), c.kind if (phase, c.kind) in _USUAL else f"{phase}_{c.kind}"

    def overlapped(self) -> dict[str, int]:
        """Per step: data-parallel and context-parallel all-gathers (forward and backward) and
        reduce-scatters that compute overlaps, after the passes."""
        by_label: dict[str, list[Collective]] = {"dp": [], "cp": []}
        for _, c in self._per_step(1):
            if c.overlapped and self._label(c) in by_label:
                by_label[self._label(c)].append(c)
        dp, cp = by_label["dp"], by_label["cp"]
        return {
            "prefetched_all_gathers": sum(c.kind == "all_gather" for c in dp),
            "overlapped_reduce_scatters": sum(c.kind == "reduce_scatter" for c in dp),
            "overlapped_cp_all_gathers": sum(c.kind == "all_gather" for c in cp),
            "overlapped_cp_reduce_scatters": sum(c.kind == "reduce_scatter" for c in cp),
        }

    def bucket_sizes_mb(self) -> dict[str, dict[str, float]]:
        """Sizes of the dp collectives after the passes, per name."""
        sizes: dict[str, list[float]] = {}
        for phase, c in self._per_step(1):
            label, name = self._key(phase, c)
            if label == "dp":
                sizes.setdefault(name, []).append(c.nbytes / 2**20)
        return {
            name: {"count": len(s), "min": round(min(s), 4), "max": round(max(s), 4), "total": round(sum(s), 4)}
            for name, s in sizes.items()
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.settings,
            "units": sum(u.copies for u in self.units),
            "traces": len(self.units),
            "eager_params": self.eager_params,
            "gradients_reduced_outside_graphs": self.reduced_outside,
            **self.counts(),
            **self.overlapped(),
            "bucket_sizes_mb": self.bucket_sizes_mb(),
            "cost_model": self.cost_model,
            "compile_seconds": round(self.compile_seconds, 2),
        }

    def summary(self) -> str:
        parts = [
            f"{label} {name} {c['before']}->{c['after']}"
            for label, table in self.counts().items()
            for name, c in sorted(table.items())
        ]
        overlap = self.overlapped()
        return (
            f"compile report ({self.settings.get('bucketing')} bucketing, "
            f"{sum(u.copies for u in self.units)} compiled units, {len(self.units)} traced): "
            f"collectives per step {', '.join(parts) or 'none'}; overlapping compute: "
            f"{overlap['prefetched_all_gathers']} dp all-gathers, {overlap['overlapped_reduce_scatters']} "
            f"reduce-scatters"
            + (
                f", {overlap['overlapped_cp_all_gathers']} cp all-gathers, "
                f"{overlap['overlapped_cp_reduce_scatters']} cp reduce-scatters"
                if "cp" in self.counts()
                else ""
            )
            + f"; compile {self.compile_seconds:.1f} s"
            + ("; gradients reduced once per step after the backwards" if self.reduced_outside else "")
        )

    def write(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    def finish(self) -> None:
        """Log the summary and, on rank 0, write the JSON report to `path`."""
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        logger.info(self.summary())
        if self.path:
            self.write(self.path)
