"""Activation checkpointing per transformer block: none, full, selective by op, or every k-th block.

Blocks are checkpointed in place (their `forward` is replaced on the instance), so parameter names do not
change with the AC mode; checkpoints, init and compile plans address the same FQNs in every layout.

With torch.compile (torch 2.13), full checkpointing *inside* a compiled region whose inputs are DTensors
fails in AOTAutograd. So a fully checkpointed block keeps an eager checkpoint around its compiled body
(`compile.py` compiles `_ac_inner`), while selective-op checkpointing (which saves at least one op) runs
inside the compiled block. Both work with and without compile.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from types import MethodType

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from titanlite.config import ActivationCheckpoint

# Outputs worth keeping: expensive to recompute (matmuls, attention) or communication (TP reductions).
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_reduce.default,
}


def _op_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpoint_block(block: nn.Module, context_fn: Callable | None, full: bool) -> None:
    block._ac_inner = block.forward
    block._ac_full = full
    kwargs = dict(use_reentrant=False, preserve_rng_state=False)
    if context_fn is not None:
        kwargs["context_fn"] = context_fn

    def forward(self, *args):
        return checkpoint(self._ac_inner, *args, **kwargs)

    block.forward = MethodType(forward, block)


def apply_ac(blocks: nn.ModuleDict, cfg: ActivationCheckpoint) -> None:
    """Checkpoint the blocks of `blocks` as `cfg` says."""
    if cfg.mode == "none":
        return
    if cfg.mode == "full":
        for block in blocks.values():
            _checkpoint_block(block, None, full=True)
    elif cfg.selective_ac_option == "op":
        context = partial(create_selective_checkpoint_contexts, _op_policy)
        for block in blocks.values():
            _checkpoint_block(block, context, full=False)
    else:
        every = int(cfg.selective_ac_option)
        for i, block in enumerate(blocks.values()):
            if i % every == 0:
                _checkpoint_block(block, None, full=True)
