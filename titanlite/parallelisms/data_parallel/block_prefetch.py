"""SimpleFSDP's collectives issued eagerly one unit ahead around per-block compiled graphs (compile scope
`prefetch`, which installs it: `compile/prefetch.py`).

A per-block graph can neither start the next block's all-gather nor leave its reduce-scatter running
past its end, so here the collectives leave the graphs: each gather hands out the weight gathered here
as a graph input (`ReplicateComputation.step_cache` = `kept_gathers.hand_out`) and routes its gradient
to its fp32 sink. The units are [embedding], each block, [norm, output]: unit i's forward pre-hook waits
its flat all-gather and starts unit i+1's; a hook before unit i's backward (its recompute) waits its
re-gather, starts unit i-1's and drops unit i+1's weights; a unit's reduce-scatter (`StepReduction`)
starts when its last gradient arrives and is written during the next unit's backward. It is data
parallelism's mechanism over its gathers and sinks; docs/compile.md has what it handles and refuses.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite import torch_support
from titanlite.parallelisms.data_parallel.kept_gathers import hand_out
from titanlite.parallelisms.data_parallel.replicate_compute import ReplicateComputation
from titanlite.parallelisms.data_parallel.reshard import ReshardPolicy
from titanlite.parallelisms.data_parallel.simple_fsdp import parametrized, simple_fsdp_states
from titanlite.parallelisms.data_parallel.step_reduction import StepReduction
from titanlite.parallelisms.units import Units

Pair = tuple[ReplicateComputation, DTensor]

_ALL_GATHER = torch_support.flat_all_gather()


@dataclass
class _Gather:
    """One unit's flat all-gather in flight (or done: `work` None)."""

    members: list[tuple[Pair, int, int, int]]
    """((gather, param), first row width offset, rows per rank, width per rank), in buffer elements."""
    ranks: int
    out: torch.Tensor
    work: Any = None
    inp: torch.Tensor | None = None


@dataclass
class _Unit:
    name: str
    pairs: list[Pair]
    block: bool
    """Holds a transformer block (matmuls: compute that overlaps the neighbours' collectives)."""
    freed: bool
    """Its gathered weights are dropped after forward and gathered again before its backward."""
    pending: list[_Gather] = field(default_factory=list)


def _buffer_dtype(gather: ReplicateComputation, param: DTensor) -> torch.dtype:
    """The dtype of the flat buffer `param` travels in: bytes where it has a wire format, else the param dtype."""
    return torch.uint8 if gather.wire is not None else gather.mp.param_dtype or param.dtype


def flat_gathers(pairs: list[Pair]) -> list[list[Pair]]:
    """`pairs` split by what one collective can carry: the same dp mesh, mode and buffer dtype."""
    groups: dict[tuple, list[Pair]] = {}
    for gather, param in pairs:
        groups.setdefault((gather.dp_mesh, gather.mode, _buffer_dtype(gather, param)), []).append((gather, param))
    return list(groups.values())


def _start_gather(pairs: list[Pair]) -> _Gather:
    """Pack the local shards (cast to the param dtype, or their wire format's bytes; each padded to its rows
    per rank) into one buffer and all-gather it asynchronously over the shard dim of the dp mesh (nothing
    for replicate)."""
    gather0, param0 = pairs[0]
    dtype = _buffer_dtype(gather0, param0)
    mesh = gather0.dp_mesh
    ranks = 1 if gather0.mode == "replicate" else mesh.size(mesh.ndim - 1)
    members, offset = [], 0
    for gather, param in pairs:
        shape = gather.tp_local_shape or param.shape
        rows = -(-shape[0] // ranks)
        width = rows * math.prod(shape[1:]) * (gather.wire.itemsize if gather.wire is not None else 1)
        members.append(((gather, param), offset, rows, width))
        offset += width
    device = param0.to_local().device
    with torch.no_grad():
        inp = torch.zeros(offset, dtype=dtype, device=device)
        for (gather, param), start, _, _ in members:
            local = (param.to_local() if gather.wire is None else gather.wire.shard_bytes(param)).reshape(-1)
            inp[start : start + local.numel()].copy_(local)
        if ranks == 1:
            return _Gather(members, 1, inp)
        out = torch.empty(ranks * offset, dtype=dtype, device=device)
        work = _ALL_GATHER(out, inp, group=mesh.get_group(mesh.ndim - 1), async_op=True)
    return _Gather(members, ranks, out, work, inp)


def _finish_gather(g: _Gather) -> None:
    """Wait `g` and hand each gathered (tp-local) weight to its gather as `kept` (from its wire format's
    bytes where it has one)."""
    if g.work is not None:
        g.work.wait()
        g.work, g.inp = None, None
    total = g.out.numel() // g.ranks
    rows_of_rank = g.out.view(g.ranks, total)
    with torch.no_grad():
        for (gather, param), start, rows, width in g.members:
            shape = gather.tp_local_shape or param.shape
            piece = rows_of_rank[:, start : start + width].reshape(g.ranks * rows, -1)[: shape[0]].contiguous()
            gather.kept = piece.reshape(shape) if gather.wire is None else gather.wire.from_bytes(piece, shape)


class BlockPrefetch:
    """The hooks of module docstring on one SimpleFSDP-wrapped model; `install` builds it."""

    def __init__(self, model: nn.Module, units: list[_Unit]):
        self.model, self.units = model, units
        self.reductions: list[StepReduction | None] = [None] * len(units)
        self.in_flight: list[int] = []
        """Units whose reduce-scatter is started and not yet written, oldest first."""
        self.callback_queued = False

    # --- forward ---------------------------------------------------------------------------------------
    def before_forward(self, i: int) -> None:
        if i == 0:
            self._new_forward()
        unit = self.units[i]
        self._start(unit)  # the first unit's (the others were started by the unit before)
        self._wait(unit)
        if i + 1 < len(self.units):
            self._start(self.units[i + 1])

    def after_forward(self, i: int, output: Any) -> None:
        unit = self.units[i]
        if unit.freed:
            self._drop(unit)
        out = output[0] if isinstance(output, tuple) else output
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: self.before_backward(i))
        elif i == len(self.units) - 1:  # a forward without backward (evaluation): nothing stays gathered
            for other in self.units:
                self._drop(other)

    def _new_forward(self) -> None:
        """A new forward: drop what an unfinished one left (gathers in flight are waited: every rank
        issued them), and plan this one's reductions."""
        for unit in self.units:
            self._wait(unit)
            self._drop(unit)
        for j in self.in_flight:
            reduction = self.reductions[j]
            assert reduction is not None
            reduction.abandon()
        self.in_flight, self.callback_queued = [], False
        self.reductions = [None] * len(self.units)
        if not torch.is_grad_enabled():
            return
        for j, unit in enumerate(self.units):
            for gather, param in unit.pairs:
                if gather.sink is None or gather.sink.device != param.to_local().device:
                    gather.make_sink(param)
            reduction = StepReduction(unit.pairs, backwards=1)
            for gather, _ in unit.pairs:
                gather.on_sink_grad = self._accumulated_for(j, reduction)
            self.reductions[j] = reduction

    # --- backward --------------------------------------------------------------------------------------
    def before_backward(self, i: int) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        unit = self.units[i]
        if unit.freed:  # its re-gather was started by the unit after it (or starts now: the last unit)
            self._start(unit)
            self._wait(unit)
        if i + 1 < len(self.units):
            self._drop(self.units[i + 1])
        if i > 0 and self.units[i - 1].freed:
            self._start(self.units[i - 1])

    def _accumulated_for(self, j: int, reduction: StepReduction) -> Callable[[ReplicateComputation], None]:
        def accumulated(gather: ReplicateComputation) -> None:
            reduction.accumulated(gather)
            if reduction.all_started() and j not in self.in_flight:
                # Unit j's reduce-scatter is running: the ones before it had unit j's backward to overlap.
                for k in self.in_flight:
                    self._write(k)
                self.in_flight = [j]

        return accumulated

    def _write(self, j: int) -> None:
        reduction = self.reductions[j]
        if reduction is not None:
            reduction.finish()
            self.reductions[j] = None

    def _end_of_backward(self) -> None:
        """Wait every reduction still running (or never started: a unit without gradients) and free the
        gathered weights."""
        for j in range(len(self.units) - 1, -1, -1):
            self._write(j)
        self.in_flight, self.callback_queued = [], False
        for unit in self.units:
            self._drop(unit)

    # --- gathered weights ------------------------------------------------------------------------------
    def _start(self, unit: _Unit) -> None:
        if not unit.pending and any(g.kept is None for g, _ in unit.pairs):
            unit.pending = [_start_gather(p) for p in flat_gathers(unit.pairs)]

    def _wait(self, unit: _Unit) -> None:
        for g in unit.pending:
            _finish_gather(g)
        unit.pending = []

    def _drop(self, unit: _Unit) -> None:
        for gather, _ in unit.pairs:
            gather.kept = None


def _hand_out(gather: ReplicateComputation, x: DTensor) -> torch.Tensor:
    """The prefetched weight (`kept_gathers.hand_out`: its gradient to the sink); outside a prefetched
    forward (a module read by attribute between steps) a plain gather."""
    if gather.kept is None:
        return gather.replicate_compute(x)
    return hand_out(gather, x)


def prefetch_units(model: nn.Module, units: Units, plan: ReshardPolicy) -> list[tuple[str, nn.Module, bool, bool]]:
    """(name, module, holds a block, freed after forward) per unit, in forward order: each root module
    before the blocks on its own, each block, and the root modules after the blocks together (their
    first module's pre-hook gathers them, the last one's output starts their backward)."""
    out = [(name, model.get_submodule(name), False, False) for name in units.before]
    out += [(fqn, block, True, freed) for (fqn, block), freed in zip(units.blocks.items(), plan.blocks)]
    if units.after:
        out.append((",".join(units.after), model.get_submodule(units.after[0]), False, False))
    return out


def install(model: nn.Module, units: Units, plan: ReshardPolicy) -> BlockPrefetch:
    """Route `model`'s SimpleFSDP gathers through the prefetcher (module docstring); call after
    `simple_fsdp.data_parallel`. Returns the prefetcher (its hooks keep it alive)."""
    for state in simple_fsdp_states(model):
        state.unreduced = True  # gradients to the sinks, for the life of the model
    specs = prefetch_units(model, units, plan)
    found = [_Unit(name, unit_pairs(model, name), block, freed) for name, _, block, freed in specs]
    for gather, _ in (pair for unit in found for pair in unit.pairs):
        gather.step_cache = _hand_out
    prefetch = BlockPrefetch(model, found)
    for i, (name, module, block, _) in enumerate(specs):
        module.register_forward_pre_hook(lambda m, args, i=i: prefetch.before_forward(i))
        last = module if block or "," not in name else model.get_submodule(name.split(",")[-1])
        last.register_forward_hook(lambda m, args, out, i=i: prefetch.after_forward(i, out))
    return prefetch


def unit_pairs(model: nn.Module, name: str) -> list[Pair]:
    """The (gather, parameter) pairs of the unit `name` (module FQNs joined by commas)."""
    return [pair for fqn in name.split(",") for pair in parametrized(model.get_submodule(fqn))]
