"""Counting the collectives of compiled graphs: which collective each FX node launches, its size, and
whether compute overlaps it, read from the graphs AOTAutograd hands the compilers (never at runtime).

A collective is *overlapped* when a compute operation (one torch counts FLOPs for: matmuls, attention)
lies between its start and its first wait in the graph's order. It moves *activations* (context or tensor
parallelism) rather than parameters or gradients when compute feeds it (an all-gather) or it feeds
compute (a reduce-scatter): data parallelism's gathers depend on parameters only and its reduce-scatters
flow to the graph's outputs, bucketed or not. The bucketing pass and the compile report read these counts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.fx.operator_schemas import normalize_function
from torch.utils._pytree import tree_leaves

_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")


@dataclass(frozen=True)
class Collective:
    kind: str
    group_name: str
    group_size: int
    nbytes: int
    """Bytes of the larger side (the unsharded buffer of an all-gather or reduce-scatter)."""
    overlapped: bool = False
    """Compute runs between its start and its first wait in the graph (module docstring)."""
    activation: bool = False
    """It moves activations, not parameters or their gradients (module docstring)."""

    @classmethod
    def from_node(cls, node: fx.Node) -> Collective | None:
        """The collective `node` launches (a `_c10d_functional` op other than wait_tensor), else None."""
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            return None
        if target.namespace != "_c10d_functional":
            return None
        kind = next((k for k in _KINDS if target._opname.startswith(k)), None)
        if kind is None:
            return None
        _, kwargs = normalize_function(target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
        group_name = str(kwargs["group_name"])
        group_size = kwargs.get("group_size") or dist.distributed_c10d._get_group_size_by_name(group_name)
        # The unsharded side: an all-gather's output, the input of every other collective.
        return cls(kind, group_name, int(group_size), _bytes(node if kind == "all_gather" else node.args[0]))


def _bytes(nodes: Any) -> int:
    vals = [n.meta.get("val") for n in tree_leaves(nodes) if isinstance(n, fx.Node)]
    return sum(v.numel() * v.element_size() for v in tree_leaves(vals) if isinstance(v, torch.Tensor))


def graph_collectives(gm: fx.GraphModule) -> list[Collective]:
    """Every collective in `gm` in graph order, with whether compute overlaps it and whether it moves
    activations; collectives wrapped in inductor `control_deps` subgraphs (its overlap ordering) count as
    the operation they wrap, and only their data arguments count as inputs."""
    from torch._inductor.fx_passes.overlap_scheduling import is_compute_node

    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    ops = [_wrapped_op(gm, n) for n in nodes]
    inputs = [[index[a] for a in tree_leaves(args) if isinstance(a, fx.Node) and a in index] for _, args in ops]
    is_compute = [bool(is_compute_node(op)) for op, _ in ops]
    compute = [0]  # compute[i]: compute operations among nodes[:i]
    after_compute = [False] * len(nodes)  # a compute operation's output reaches the node
    first_wait: dict[fx.Node, int] = {}
    for i, (op, args) in enumerate(ops):
        compute.append(compute[-1] + is_compute[i])
        after_compute[i] = any(is_compute[j] or after_compute[j] for j in inputs[i])
        if op.target is torch.ops._c10d_functional.wait_tensor.default and isinstance(args[0], fx.Node):
            first_wait.setdefault(args[0], i)
    feeds_compute = [False] * len(nodes)  # the node's output reaches a compute operation
    for i in reversed(range(len(nodes))):
        if is_compute[i] or feeds_compute[i]:
            for j in inputs[i]:
                feeds_compute[j] = True
    out = []
    for i, (node, (op, _)) in enumerate(zip(nodes, ops)):
        if (c := Collective.from_node(op)) is not None:
            wait = first_wait.get(node)
            overlapped = wait is not None and compute[wait] > compute[i + 1]
            activation = after_compute[i] if c.kind == "all_gather" else c.kind == "reduce_scatter" and feeds_compute[i]
            out.append(dataclasses.replace(c, overlapped=overlapped, activation=activation))
    return out


def _wrapped_op(gm: fx.GraphModule, node: fx.Node) -> tuple[fx.Node, tuple]:
    """(the operation `node` runs, its arguments in `gm`): for a `control_deps` node, the one operation of
    its subgraph, called with the node's arguments after (dependencies, subgraph)."""
    from torch._inductor.fx_passes.control_dependencies import control_deps

    if node.op == "call_function" and node.target is control_deps:
        sub = getattr(gm, node.args[1].target)
        return next(n for n in sub.graph.nodes if n.op == "call_function"), tuple(node.args[2:])
    return node, tuple(node.args)
