"""Llama 3's part of the parallelize plan: its block container and its tensor-parallel plan.

The framework applies every parallelism, in its own order (`titanlite/parallelisms/parallelize.py`);
what is Llama's is which modules form the blocks and which projections split column- or row-wise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from titanlite.parallelisms.units import Units

if TYPE_CHECKING:
    from titanlite.parallelisms.tensor_parallel import TensorParallelPlan


def llama_units(model: nn.Module) -> Units:
    return Units.of(model, "layers")


def llama_tp_plan(loss_parallel: bool) -> TensorParallelPlan:
    """Megatron-style TP with sequence parallelism on norms, the residual stream and the embedding
    output; with loss parallel the logits stay sharded on the vocab dim (the loss runs under
    `loss_parallel()` without gathering them). Between pipeline stages the hidden states travel
    sequence-sharded, as local tensors."""
    # Imported here: the family's spec is read by the launcher's preflight, which imports no DTensor.
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    from titanlite.parallelisms.tensor_parallel import TensorParallelPlan

    return TensorParallelPlan(
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
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        },
    )
