"""Activation checkpointing per transformer block: none, full, selective by op, or every k-th block.

Selective by op saves attention, the tensor-parallel reductions and matmuls, and recomputes the rest: `op`
(the default, as TorchTitan) saves every other matmul of a block (wq, wv, w1, w2 in Llama), `op_all_mm`
every one. Blocks are checkpointed in place (their `forward` replaced on the instance), so parameter names do
not change with the AC mode. `apply_ac` returns one `CheckpointedBlock` per checkpointed block, whose `body`
the compiler reads: full checkpointing inside a compiled region of DTensors fails in AOTAutograd, so a fully
checkpointed block is an eager checkpoint around a compiled body (scope `block`) or, in a whole-model graph,
recompute tags instead of a checkpoint (`in_graph`). A full checkpoint's recompute replays the host values
its forward read (`host_replay.HostReplay`), adding no host sync. Memory of each mode: docs/dry_run.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from titanlite.config import ActivationCheckpoint
from titanlite.parallelisms.host_replay import HostReplay

BlockAC = Literal["none", "full", "op", "op_all_mm"]
OP_OPTIONS = ("op", "op_all_mm")
"""The `selective_ac_option` values that select by op (module docstring); an integer k = every k-th block."""

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


_MM = torch.ops.aten.mm.default


def _save_all_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _every_other_mm_context() -> Any:
    """A fresh pair of selective-checkpoint contexts for one call of a block: the matmuls are counted
    separately in forward and in recomputation (which replays the same ops), and the odd-numbered ones
    are saved."""
    counts = {False: 0, True: 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func == _MM:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return _save_all_policy(ctx, func)

    return create_selective_checkpoint_contexts(policy)


def block_ac(cfg: ActivationCheckpoint, index: int) -> BlockAC:
    """How block `index` is checkpointed under `cfg` (the one rule; the memory estimate reads it too)."""
    if cfg.mode == "none":
        return "none"
    if cfg.mode == "full":
        return "full"
    if cfg.selective_ac_option in OP_OPTIONS:
        return cfg.selective_ac_option  # type: ignore[return-value]
    return "full" if index % int(cfg.selective_ac_option) == 0 else "none"


@dataclass
class CheckpointedBlock:
    mode: Literal["full", "op", "op_all_mm"]
    body: Callable[..., Any]
    """Runs inside the checkpoint: the block's own forward, or its compiled form."""
    in_graph: bool = False
    """Full mode realised by the compiler's recompute tags: the forward calls `body` unwrapped."""


def _checkpoint_block(
    block: nn.Module, mode: Literal["full", "op", "op_all_mm"], replay: HostReplay | None
) -> CheckpointedBlock:
    ac = CheckpointedBlock(mode, block.forward)
    kwargs: dict[str, Any] = dict(use_reentrant=False, preserve_rng_state=False)
    if mode == "full" and replay is not None:
        kwargs["context_fn"] = replay.checkpoint_contexts
    elif mode == "op":
        kwargs["context_fn"] = _every_other_mm_context
    elif mode == "op_all_mm":
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, _save_all_policy)

    def forward(*args: Any) -> Any:
        if ac.in_graph:
            return ac.body(*args)
        return checkpoint(ac.body, *args, **kwargs)

    block.forward = forward
    return ac


def apply_ac(
    blocks: dict[str, nn.Module], cfg: ActivationCheckpoint, replay: HostReplay | None = None
) -> dict[str, CheckpointedBlock]:
    """Checkpoint `blocks` (FQN -> block, in order) as `cfg` says; returns the checkpointed ones by FQN.
    `replay`: the host reads the blocks' forwards make, replayed by full checkpointing's recompute.

    "Every k-th block" counts blocks by their key in the model (`layers.12` is block 12), so a pipeline
    stage holding blocks 12.. checkpoints the blocks the whole model would."""
    out = {}
    for i, (fqn, block) in enumerate(blocks.items()):
        key = fqn.rsplit(".", 1)[-1]
        mode = block_ac(cfg, int(key) if key.isdigit() else i)
        if mode != "none":
            out[fqn] = _checkpoint_block(block, mode, replay)
    return out
