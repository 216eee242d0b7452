"""The tensor-parallel styles of a dense decoder (Llama 3, Qwen3): Megatron-style TP with sequence
parallelism on norms, the residual stream and the embedding output; with loss parallel the logits stay
sharded on the vocab dim (the loss runs under `loss_parallel()` without gathering them). Between pipeline
stages the hidden states travel sequence-sharded, as local tensors.

The embedding (`RowwiseParallel`) and the output projection (`ColwiseParallel`) both shard their weight
on its vocabulary rows (dim 0), so a weight the two share (tied embeddings) has one layout.

With per-head q/k RMSNorms (Qwen3's QK-norm) each rank normalises its own heads, [b, s, local heads,
head_dim]: the norms' weights are replicated (`SequenceParallel` over the heads dim, whose weight
gradients are reduced over tp).

A MoE layer (Qwen3-MoE, DeepSeek-V3; `moe_tp_block`) is not split: its input's sequence shards are gathered,
every tp rank routes the same tokens with the same (replicated) router and experts, and the output is split
back into sequence shards. So the experts' weights and gradients are whole and equal on every tp rank, expert
parallelism (which splits them over the data-parallel shard ranks) needs nothing of tp, and the router's
auxiliary loss sees the whole microbatch as in one process. The price is the MoE layer's compute done tp
times; splitting the experts' tokens over tp is not done."""

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


def moe_tp_block() -> dict[str, Any]:
    """The block styles of a MoE layer `moe` with `moe.gate` and `moe.experts` (module docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    from titanlite.parallelisms.data_parallel.replicate_weights import ReplicateWeights

    return {
        "moe": PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
            use_local_output=True,
        ),
        "moe.gate": ReplicateWeights(),
        "moe.experts": ReplicateWeights(),
    }


def dense_tp_divisible(args: Any) -> dict[str, int]:
    """What the plan splits over tp and tp must divide (`ParallelSeams.tp_divisible`): the query heads, the
    key/value heads and the SwiGLU's width (`args.ffn_hidden_dim`)."""
    return {"n_heads": args.n_heads, "n_kv_heads": args.kv_heads, "ffn_dim": args.ffn_hidden_dim}
