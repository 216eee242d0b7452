"""DeepSeek-V3's tensor-parallel styles: the latent attention split by heads, the MoE layer as Qwen3-MoE's.

Latent attention (Megatron-style, sequence-parallel around it as the dense decoder's):
- `wq` (no query latent) or `wq_b`, and `wkv_b`: colwise, split by heads (each rank expands its heads'
  queries, keys without RoPE and values);
- `wq_a`, `q_norm`, `wkv_a`, `kv_norm`: replicated (the latents are small: kv_lora_rank + qk_rope_head_dim
  and q_lora_rank wide), computed on the replicated input as DTensors, so their weight gradients, parts
  of one sum on each rank, are reduced by DTensor;
- the rotary key part, one head every head shares, enters each rank's heads as a local tensor whose
  gradient is summed over tp (`parallelisms/tensor_parallel/partial_grad.head_local`);
- `wo`: rowwise, its output sequence-sharded.
The dense layers' SwiGLU and the embedding, norms and output are the dense decoder's
(`models/common/tensor_parallel.py`). The MoE layer is the MoE families' (`tensor_parallel.moe_tp_block`):
its tokens gathered, the router and routed experts replicated over tp; the shared experts, a SwiGLU on the
same gathered tokens, split colwise/rowwise over tp and reduced back to the whole tokens.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from titanlite.models.common.tensor_parallel import dense_tp_styles, moe_tp_block
from titanlite.parallelisms.data_parallel.replicate_weights import ReplicateWeights
from titanlite.parallelisms.tensor_parallel.unit import TensorParallelStyles


def deepseek_v3_tp_styles(loss_parallel: bool) -> TensorParallelStyles:
    dense = dense_tp_styles(loss_parallel)
    return TensorParallelStyles(
        roots=dense.roots,
        block={
            # The attention's input, wq, wo, the block's norms and the dense layers' feed-forward.
            **{k: v for k, v in dense.block.items() if k not in ("attention.wk", "attention.wv")},
            **moe_tp_block(),
            "attention.wq_a": ReplicateWeights(),
            "attention.q_norm": ReplicateWeights(),
            "attention.wq_b": ColwiseParallel(),
            "attention.wkv_a": ReplicateWeights(),
            "attention.kv_norm": ReplicateWeights(),
            "attention.wkv_b": ColwiseParallel(),
            "moe.shared_experts.w1": ColwiseParallel(),
            "moe.shared_experts.w3": ColwiseParallel(),
            "moe.shared_experts.w2": RowwiseParallel(output_layouts=Replicate()),
        },
    )
