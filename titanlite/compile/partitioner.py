"""The forward/backward partitioner of compiled SimpleFSDP graphs: torch's min-cut partitioner (which,
unlike the default one, honours `passes.RecomputeTagPass`'s tags, applied to the joint graph first) with
the saved values put in the order AOTAutograd reads them.

Recomputing an operation torch marks random (attention, for its dropout), torch 2.13's min-cut partitioner
appends its saved RNG state after the saved opaque objects (DTensor gradients' `DeviceMesh`), where
AOTAutograd's runtime expects every tensor first (`expected all tensors_saved_with_vc_check to be Tensors,
got ... DeviceMesh`). `_saved_opaque_objects_last` moves the opaque objects behind the tensors, in the
forward's outputs and the backward's inputs alike; where the order is already right it changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files


class Partitioner(CustomPartitionerFn):
    """Min-cut partitioning after `tagging` (a joint-graph pass, None when inductor already ran it as its
    `joint_custom_post_pass`). Used as the `partition_fn` of the aot_eager backend and as inductor's
    `custom_partitioner_fn`."""

    def __init__(self, tagging: Callable[[fx.Graph], None] | None, uuid: Any):
        self.tagging, self._uuid = tagging, uuid

    def __call__(
        self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        if self.tagging is not None:
            self.tagging(gm.graph)
        fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        _saved_opaque_objects_last(fw, bw, kwargs["num_fwd_outputs"])
        return fw, bw

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,), extra=repr(self._uuid))


def _is_opaque(node: Any) -> bool:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val is not None and not isinstance(val, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool, int))


def _is_sym(node: Any) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))


def _saved_opaque_objects_last(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> None:
    """Saved values as AOTAutograd's runtime slices them: tensors, then opaque objects, then symbols."""
    output = fw.graph.output_node()
    outs = list(output.args[0])
    saved = outs[num_fwd_outputs:]
    n_sym = 0
    while n_sym < len(saved) and _is_sym(saved[len(saved) - 1 - n_sym]):
        n_sym += 1
    body, syms = saved[: len(saved) - n_sym], saved[len(saved) - n_sym :]
    opaque = [n for n in body if _is_opaque(n)]
    tensors = [n for n in body if not _is_opaque(n)]
    if not opaque or body == tensors + opaque:
        return
    if any(isinstance(n, fx.Node) and n.meta.get("saved_tensor_with_no_vc_check") for n in tensors):
        return  # a layout this repair does not know; leave torch's
    placeholders = list(bw.graph.find_nodes(op="placeholder"))
    first_tangent = next((p for p in placeholders if "tangent" in p.name), None)
    if first_tangent is None:  # torch saves RNG states only for a backward with tangents
        return
    output.args = (tuple(outs[:num_fwd_outputs] + tensors + opaque + syms),)
    fw.recompile()
    for p in placeholders[: placeholders.index(first_tangent)]:  # saved values; tangents keep their order
        if _is_opaque(p):
            first_tangent.prepend(p)
    bw.recompile()
