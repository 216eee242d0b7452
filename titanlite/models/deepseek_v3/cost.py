"""DeepSeek-V3's cost per token for the step-time model (`titanlite/models/cost.py` says what each field is).

The model's blocks differ (the first `first_k_dense_replace` are dense, the rest MoE), and the step-time model times
one block shape, so each field is the mean over the blocks (a pipeline stage of other proportions is timed at the
model's mean). Matmuls at 2 FLOPs per weight element and token: multi-head latent attention's projections (the
latents, their up-projections, wo), the dense layers' SwiGLU, and per MoE layer the router, the top_k routed experts
(active FLOPs only) and the shared experts. Tensor parallelism splits attention's heads, the dense SwiGLU and the
shared experts; the router and the routed experts run whole on every tp rank (`replicated_matmul_flops`). Attention:
QK^T over qk_head_dim and PV over v_head_dim, halved under the causal mask; context parallelism gathers each head's
key and value (qk_head_dim + v_head_dim per head). Selective AC `op` recomputes the routed experts' grouped GEMMs
(no saved op) and about half of the other matmuls. Elementwise traffic follows the dense decoder's counts
(`models/common/dense_cost.py`) for the ops this model runs. Under expert parallelism a MoE layer's dispatch sends
top_k rows of `dim` per token (`expert_parallel_elements`). Collectives under TP: four per dense block's forward,
three per MoE block (its output is split back locally). docs/layout_search.md#deepseek-v3.
"""

from __future__ import annotations

from typing import Any

from titanlite.models.cost import BlockCost, ModelCost


def step_cost(args: Any, seq_len: int, compute_bytes: int) -> ModelCost:
    """`args`: the family's ModelArgs."""
    d, h, e, v = args.dim, args.n_heads, compute_bytes, args.vocab_size
    qk, vd, r, kv, ql = args.qk_head_dim, args.v_head_dim, args.qk_rope_head_dim, args.kv_lora_rank, args.q_lora_rank
    q_proj = d * ql + ql * h * qk if ql else d * h * qk
    attn_weights = q_proj + d * (kv + r) + kv * h * (args.qk_nope_head_dim + vd) + h * vd * d
    # Elementwise: two block norms and the latents' norms, RoPE on the RoPE parts, the joined queries and
    # keys, residual adds.
    attn_eager = (2 * e + 16) * (2 * d + kv + ql) + (2 * e + 44) * r * (h + 1) + 2 * e * h * (2 * qk + vd) + 6 * e * d
    attn_fused = (9 + 2) * e * d + 2 * e * (kv + ql) + 2 * e * h * (2 * qk + vd)
    dense_ffn = 3 * d * args.ffn_dim
    routed = args.top_k * 3 * d * args.moe_ffn_dim
    shared = 3 * d * args.n_shared_experts * args.moe_ffn_dim
    router = d * args.num_experts
    moe_layers = sum(map(args.is_moe, range(args.n_layers)))
    share = moe_layers / args.n_layers  # the MoE layers' share of the blocks
    rows = args.top_k * d
    moe_eager = 20 * args.num_experts + 9 * e * rows + 5 * e * args.top_k * args.moe_ffn_dim
    moe_eager += 5 * e * args.n_shared_experts * args.moe_ffn_dim + 3 * e * d
    moe_fused = 4 * args.num_experts + 4 * e * rows + 3 * e * (args.top_k + args.n_shared_experts) * args.moe_ffn_dim
    matmul = attn_weights + (1 - share) * dense_ffn + share * (routed + shared + router)
    block = BlockCost(
        matmul_flops=2 * matmul,
        attention_flops=seq_len * h * (qk + vd),
        op_recompute_flops=2 * share * routed + (matmul - share * routed),
        elementwise_bytes=attn_eager + (1 - share) * 5 * e * args.ffn_dim + share * moe_eager,
        fused_elementwise_bytes=attn_fused + (1 - share) * 3 * e * args.ffn_dim + share * moe_fused,
        tp_collectives=round(4 - share),
        tp_recomputed_selective=2,
        context_parallel_elements=h * (qk + vd),
        replicated_matmul_flops=2 * share * (routed + router),
        expert_parallel_elements=share * rows,
    )
    return ModelCost(
        block=block,
        output_matmul_flops=2 * d * v,
        loss_bytes=32 * v,
        fused_loss_bytes=12 * v,
        hidden=d,
        flops_per_token=args.flops_per_token(seq_len),
    )
