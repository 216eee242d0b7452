"""What one token costs a model family: the work the step-time model (`titanlite/planning/step_time.py`) times.

A family describes its repeated block and its output once (`ModelSpec.planning.step_cost`), per token of one
sequence of `seq_len` tokens and for the forward pass only; the step-time model multiplies out the
backward, the recomputation of activation checkpointing, the tensor-parallel split and the batch.
Parameter bytes (what data parallelism moves) come from the model's real shard shapes instead
(`titanlite/planning/param_shapes.py`), so they are not repeated here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockCost:
    """One transformer block's forward, per token."""

    matmul_flops: float
    """FLOPs of its weight matmuls (2 x the weights' elements)."""
    attention_flops: float
    """FLOPs of the attention scores and the weighted values as a causal kernel computes them (half of
    the full s x s product)."""
    op_recompute_flops: float
    """Matmul FLOPs that selective AC `op` (every other matmul saved) runs again in backward."""
    elementwise_bytes: float
    """Memory traffic of the non-matmul ops as eager kernels run them (each op reads its inputs and
    writes its output), at the compute dtype."""
    fused_elementwise_bytes: float
    """The same when compiled: fused regions read their inputs and write their outputs once."""
    tp_collectives: int
    """Activation collectives (all-gather or reduce-scatter of one hidden state) of its forward under
    tensor parallelism with sequence parallelism; its backward issues as many."""
    tp_recomputed_selective: int
    """Of those, the ones selective AC runs again in backward (it saves matmul, attention and
    reduce-scatter outputs, not all-gathers, whose outputs the saved matmuls' weight gradients need)."""
    context_parallel_elements: int = 0
    """Elements per token that its attention all-gathers over the context-parallel ranks (the keys and
    values, before tensor parallelism splits their heads); 0 for a family without context parallelism."""
    replicated_matmul_flops: float = 0.0
    """Matmul FLOPs that every tensor-parallel rank runs whole, on the gathered sequence (a MoE layer that
    tensor parallelism does not split); `matmul_flops` counts them too, so the rest is split over tp."""
    expert_parallel_elements: float = 0.0
    """Elements per token that one dispatch of its MoE layer sends to the experts' ranks (top_k rows of the
    hidden state; the combine sends as many back); 0 for a block without routed experts."""


@dataclass(frozen=True)
class ModelCost:
    block: BlockCost
    output_matmul_flops: float
    """The output projection's forward FLOPs per token (the last pipeline stage)."""
    loss_bytes: float
    """Eager memory traffic of the loss over the logits, forward and backward, per token."""
    fused_loss_bytes: float
    hidden: int
    """Elements of one token's hidden state: a pipeline stage's send, a TP activation collective."""
    flops_per_token: float
    """Training FLOPs per token as the trainer reports MFU (`args.flops_per_token`)."""
