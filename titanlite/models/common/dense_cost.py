"""A dense decoder's cost per token (Llama 3, Qwen3) for the step-time model (`titanlite/models/cost.py`
says what each field is).

Matmuls: wq, wk, wv, wo, w1, w2, w3 (2 FLOPs per weight element and token); selective AC `op` saves
every other matmul of a block (wq, wv, w1, w2) and recomputes wk, wo and w3
(`parallelisms/activation_checkpoint.py`). Attention: QK^T and PV, 2 x 2 x seq x head_dim FLOPs per
head and token without the causal mask, half with it.

Elementwise traffic, counted per element of the tensors `model.py` runs them on (e = compute dtype
bytes, fp32 = 4):

    eager                                            bytes per element
    RMSNorm: x.float(), rms_norm, type_as            (e + 4) + 8 + (4 + e)      on dim, twice
    QK-norm (Qwen3): the same RMSNorm                (e + 4) + 8 + (4 + e)      on q and k
    RoPE: float(), 4 muls and 2 adds on halves,      (e + 4) + 16 + 12 + 8 + (4 + e)   on q and k
          stack, type_as
    attention output transpose + reshape copy        2e                         on dim
    residual adds                                    3e                         on dim, twice
    SwiGLU: silu, mul                                2e + 3e                    on ffn_dim
    compiled (fused regions read inputs, write outputs once)
    norm 1; residual add + norm 2; final residual    2e; 4e; 3e                 on dim
    RoPE (after QK-norm: fused with it)              2e                         on q and k
    attention output copy                            2e                         on dim
    SwiGLU                                           3e                         on ffn_dim

The loss: the logits cast to fp32, log-softmax and its gradient, the cast back (about 32 bytes per
vocabulary entry eager, 12 fused). Under tensor parallelism with sequence parallelism a block's forward
runs four activation collectives: all-gathers before attention and the FFN, reduce-scatters after wo
and w2 (`parallelize.py`); selective AC recomputes the two all-gathers. Under context parallelism a
block all-gathers its keys and values (2 x kv_heads x head_dim per token) over the cp ranks.
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
