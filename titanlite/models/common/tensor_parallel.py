"""The tensor-parallel styles of a dense decoder (Llama 3, Qwen3): Megatron-style TP with sequence
parallelism on norms, the residual stream and the embedding output; with loss parallel the logits stay
sharded on the vocab dim (the loss runs under `loss_parallel()` without gathering them). Between pipeline
stages the hidden states travel sequence-sharded, as local tensors.

The embedding (`RowwiseParallel`) and the output projection (`ColwiseParallel`) both shard their weight
on its vocabulary rows (dim 0), so a weight the two share (tied embeddings) has one layout.

With per-head q/k RMSNorms (Qwen3's QK-norm) each rank normalises its own heads, [b, s, local heads,
head_dim]: the norms' weights are replicated (`SequenceParallel` over the heads dim, whose weight
gradients are reduced over tp)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from titanlite.parallelisms.tensor_parallel.unit import TensorParallelStyles


def dense_tp_styles(loss_parallel: bool, qk_norm: bool = False) -> TensorParallelStyles:
    """The plan (module docstring) for blocks `attention.{wq,wk,wv,wo[,q_norm,k_norm]}`, `feed_forward.w1..3`,
    `attention_norm`, `ffn_norm`, and the roots `tok_embeddings`, `norm`, `output`."""
    # Imported here: the family's spec is read by the launcher's preflight, which imports no DTensor.
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    from titanlite.parallelisms.tensor_parallel.unit import TensorParallelStyles

    norms = (
        {
            "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        }
        if qk_norm
        else {}
    )
    return TensorParallelStyles(
        roots={
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(
                input_layouts=Shard(1),
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            ),
        },
        block={
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                # (x, cos, sin, mask): RoPE tables and the batch's mask are replicated like its tokens.
                input_layouts=(Shard(1), None, None, None),
                desired_input_layouts=(Replicate(), None, None, None),
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            **norms,
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        },
    )


def dense_tp_divisible(args: Any) -> dict[str, int]:
    """What the plan splits over tp and tp must divide (`ParallelSeams.tp_divisible`): the query heads, the
    key/value heads and the SwiGLU's width (`args.ffn_hidden_dim`)."""
    return {"n_heads": args.n_heads, "n_kv_heads": args.kv_heads, "ffn_dim": args.ffn_hidden_dim}
