"""Compile scope `prefetch`: the eager prefetcher installed on the wrapped model, and its collectives
counted in the compile report.

Under this scope the per-block graphs hold no collective: SimpleFSDP's gathers and reductions are issued
by eager hooks one unit ahead (`parallelisms/data_parallel/block_prefetch.py`, data parallelism's own
mechanism over its gathers and sinks). Here compilation installs it, after data parallelism, and adds
what it issues to the report as one more unit: the flat gathers and reductions per step, and which of
them compute overlaps (a unit's all-gather when the unit before it holds a block's matmuls; its
reduce-scatter when the unit after it in backward does).
"""

from __future__ import annotations

import math

from torch import nn

from titanlite.compile.collectives import Collective
from titanlite.compile.report import CompileReport
from titanlite.parallelisms.data_parallel import block_prefetch
from titanlite.parallelisms.data_parallel.reshard import ReshardPolicy
from titanlite.parallelisms.units import Units


def apply_prefetch(model: nn.Module, units: Units, reshard: ReshardPolicy, report: CompileReport) -> None:
    """Under scope `prefetch`, after data parallelism: install the eager prefetcher on `model` and add
    its collectives to `report` as one more unit; nothing under other scopes."""
    if report.settings["scope"] != "prefetch":
        return
    block_prefetch.install(model, units, reshard)
    unit = report.add_unit("prefetch (eager)", recompute_forward=False)
    for phase, (before, after) in prefetch_collectives(model, units, reshard).items():
        report.record(unit, phase, before, after)


def prefetch_collectives(model: nn.Module, units: Units, plan: ReshardPolicy) -> dict[str, tuple[list, list]]:
    """phase -> (the per-parameter collectives a step would issue unbucketed, the flat ones the prefetcher
    issues) for the compile report, with which of the flat ones compute overlaps (module docstring)."""
    specs = block_prefetch.prefetch_units(model, units, plan)
    pairs = [block_prefetch.unit_pairs(model, name) for name, *_ in specs]
    forward: tuple[list, list] = ([], [])
    backward: tuple[list, list] = ([], [])
    n = len(specs)
    for i, ((_, _, _, freed), unit) in enumerate(zip(specs, pairs)):
        # Unit i-1 computes after unit i's reduce-scatter starts (backward) and before its gather is
        # waited (forward); unit i+1's backward runs while unit i is gathered again.
        neighbour_computes = i > 0 and specs[i - 1][2]
        regather_overlapped = i + 1 < n and specs[i + 1][2]
        for group in block_prefetch.flat_gathers(unit):
            reduced = _describe(group, "reduce_scatter")
            backward[0].extend(_describe([p], "reduce_scatter") for p in group)
            backward[1].append(_overlapped(reduced, neighbour_computes))
            if group[0][0].mode == "replicate":  # nothing to gather
                continue
            gathered = _describe(group, "all_gather")
            forward[0].extend(_describe([p], "all_gather") for p in group)
            forward[1].append(_overlapped(gathered, neighbour_computes))
            if freed:
                backward[0].extend(_describe([p], "all_gather") for p in group)
                backward[1].append(_overlapped(gathered, regather_overlapped))
    return {"forward": forward, "backward": backward}


def _describe(group: list[block_prefetch.Pair], kind: str) -> Collective:
    gather0, param0 = group[0]
    mesh = gather0.dp_mesh
    dim = mesh.ndim - 1
    nbytes = 0
    for gather, param in group:
        if kind == "all_gather":
            itemsize = gather.gathered_itemsize(param)
        else:
            itemsize = (gather.mp.reduce_dtype or param.dtype).itemsize
        nbytes += math.prod(gather.tp_local_shape or param.shape) * itemsize
    if gather0.mode == "replicate":
        kind = "all_reduce"
    return Collective(kind, mesh.get_group(dim).group_name, mesh.size(dim), nbytes)


def _overlapped(c: Collective, overlapped: bool) -> Collective:
    return Collective(c.kind, c.group_name, c.group_size, c.nbytes, overlapped)
