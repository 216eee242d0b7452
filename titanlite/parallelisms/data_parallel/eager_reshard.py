"""SimpleFSDP's eager reshard-after-forward: gathered weights are not kept between forward and backward.

Gathered weights that autograd would save for backward are replaced by a recipe to gather them again
(saved-tensor hooks), so only shards stay resident between forward and backward. Each gather marked
`reshard_after_forward` records its output and recipe in its model's `SimpleFSDPState` during the forward;
the hooks installed on the model's root read them. Under torch.compile the same effect comes from tagging
the gathers must-recompute in the graph (`passes.RecomputeTagPass`), so compiled units record nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from titanlite.parallelisms.data_parallel.replicate_compute import ReplicateComputation, SimpleFSDPState
from titanlite.parallelisms.data_parallel.reshard import ReshardPolicy
from titanlite.parallelisms.data_parallel.simple_fsdp import simple_fsdp_states
from titanlite.parallelisms.units import Units


def set_reshard_after_forward(module: nn.Module, enabled: bool) -> None:
    """Turn reshard-after-forward on or off for every SimpleFSDP parameter under `module`."""
    for sub in module.modules():
        if isinstance(sub, ReplicateComputation):
            sub.reshard_after_forward = enabled


def apply_reshard(model: nn.Module, units: Units, plan: ReshardPolicy) -> None:
    """Eager reshard-after-forward for the units `plan` frees (compiled units use the graph tags instead).
    `model` is the root `simple_fsdp.data_parallel` wrapped."""
    if not plan.any:
        return
    for block, freed in zip(units.blocks.values(), plan.blocks):
        set_reshard_after_forward(block, freed)
    if plan.root:
        for name in units.roots:
            set_reshard_after_forward(model.get_submodule(name), True)
    for state in simple_fsdp_states(model):
        ReshardAfterForward(model, state)


class _Regather:
    """Stands in for a saved gathered weight (or its transpose) until backward needs it."""

    __slots__ = ("gather", "sharded", "transposed")

    def __init__(self, gather: ReplicateComputation, sharded: Any, transposed: bool):
        self.gather, self.sharded, self.transposed = gather, sharded, transposed

    def materialize(self) -> torch.Tensor:
        with torch.no_grad():
            full = self.gather.replicate_compute(self.sharded)
        return full.t() if self.transposed else full


class ReshardAfterForward:
    """Forward hooks on the root module that drop gathered weights from autograd's saved tensors."""

    def __init__(self, root: nn.Module, state: SimpleFSDPState):
        self.state = state
        self._ctx: torch.autograd.graph.saved_tensors_hooks | None = None
        root.register_forward_pre_hook(self._enter)
        root.register_forward_hook(self._exit, always_call=True)

    def _enter(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
            self._ctx.__enter__()

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None
        self.state.forget_gathered()

    def _pack(self, t: torch.Tensor) -> Any:
        """Replace a saved gathered weight (the tensor the gather returned, or its transpose) by a recipe."""
        root = t._base if t._is_view() else t
        key = id(root)
        if self.state.gathered.get(key) is not root:
            return t
        gather, sharded, shape, stride = self.state.recipes[key]
        if t.shape == shape and t.stride() == stride:
            return _Regather(gather, sharded, transposed=False)
        if t.dim() == 2 and t.shape == shape[::-1] and t.stride() == stride[::-1]:
            return _Regather(gather, sharded, transposed=True)
        return t  # an unexpected view: keep it (correct, just not resharded)


def _unpack(obj: Any) -> torch.Tensor:
    return obj.materialize() if isinstance(obj, _Regather) else obj
