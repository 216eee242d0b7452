"""A dense decoder's cost per token (Llama 3, Qwen3) for the step-time model (`titanlite/models/cost.py`
says what each field is).

Matmuls: wq, wk, wv, wo, w1, w2, w3 at 2 FLOPs per weight element and token; selective AC `op` saves every
other matmul of a block (wq, wv, w1, w2) and recomputes wk, wo and w3. Attention: QK^T and PV, halved under
the causal mask. Elementwise traffic is counted per element of the tensors `model.py` runs it on, eager
(each op reads and writes: RMSNorm and RoPE through fp32, residual adds, SwiGLU) or compiled (a fused region
reads its inputs and writes its outputs once); the loss adds about 32 bytes per vocabulary entry eager, 12
fused. Collectives: under TP with sequence parallelism four per block's forward (the two all-gathers again
under selective AC); under CP one all-gather of keys and values per block. The model: docs/layout_search.md.
"""

from __future__ import annotations

from typing import Any

from titanlite.models.cost import BlockCost, ModelCost


def step_cost(args: Any, seq_len: int, compute_bytes: int, qk_norm: bool = False) -> ModelCost:
    """`args`: dim, n_heads, kv_heads, head_dim, ffn_hidden_dim, vocab_size, flops_per_token."""
    d, h, kv, hd, f, v = args.dim, args.n_heads, args.kv_heads, args.head_dim, args.ffn_hidden_dim, args.vocab_size
    e = compute_bytes
    q, k = h * hd, kv * hd
    wq, wk, wv, wo = d * q, d * k, d * k, q * d
    w1 = w2 = w3 = d * f
    eager = 2 * (2 * e + 16) * d + (2 * e + 44) * (q + k) + 2 * e * d + 2 * 3 * e * d + 5 * e * f
    if qk_norm:
        eager += (2 * e + 16) * (q + k)
    fused = (2 + 4 + 3) * e * d + 2 * e * (q + k) + 2 * e * d + 3 * e * f
    block = BlockCost(
        matmul_flops=2 * (wq + wk + wv + wo + w1 + w2 + w3),
        attention_flops=2 * seq_len * hd * h,
        op_recompute_flops=2 * (wk + wo + w3),
        elementwise_bytes=eager,
        fused_elementwise_bytes=fused,
        tp_collectives=4,
        tp_recomputed_selective=2,
        context_parallel_elements=2 * k,
    )
    return ModelCost(
        block=block,
        output_matmul_flops=2 * d * v,
        loss_bytes=32 * v,
        fused_loss_bytes=12 * v,
        hidden=d,
        flops_per_token=args.flops_per_token(seq_len),
    )
