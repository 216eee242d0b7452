"""Qwen3-MoE's activation memory per GPU, for the dry run's memory plan (`titanlite/planning/memory.py`).

Per token of one microbatch, with the eager kernels. Attention as Llama's (`models/common/dense_activations.py`) plus
the q/k RMSNorms and the fp32 RoPE copies. Under tensor parallelism, as for Llama, sequence parallelism
divides the norms' parts by tp and attention (heads) and the dense FFN by tp, the all-gathered inputs of
the projections full size; a MoE layer runs on the whole gathered sequence on every tp rank
(`models/qwen3_moe/parallelize.py`), so its parts are not divided. A MoE layer saves the router's logits
and fp32 probabilities and, per routed (token, expert) pair (top_k of them), the gathered input, the
gate/up output, the SwiGLU product, the down output and its weighted copy; a dense layer four FFN-wide
tensors. Selective AC is counted as no AC (an upper bound). The peak is the larger of the start of
backward and the last block's backward, as for Llama.

Under expert parallelism a MoE layer's routed rows (top_k per token) leave for their experts' ranks and
come back: each all-to-all holds its send and its receive buffer ([rows, dim] each) while it runs, in the
forward (dispatch, combine) and again for the gradients in the backward. One layer's pair is in flight
at a time, beside whichever peak, so it is added to the peak. Routing is planned balanced: a rank
receives as many rows as it sends; a rank whose experts draw f times their share receives f times the
rows, and its experts' saved activations grow with them (routing is dropless: nothing caps f).
"""

from __future__ import annotations

from titanlite.models.common.activation_peak import activation_peak
from titanlite.models.qwen3_moe.model import ModelArgs
from titanlite.parallelisms.layout import Layout


def activation_bytes(args: ModelArgs, layout: Layout) -> dict[str, int]:
    """Peak activation bytes of one microbatch and its parts, and what it holds from its forward to its
    backward ("held"); `layout.blocks` and `layout.output` restrict both to a pipeline stage."""
    d, h, kv, hd, e = args.dim, args.n_heads, args.kv_heads, args.head_dim, layout.compute_dtype.itemsize
    k, i, experts, t = args.top_k, args.moe_ffn_dim, args.num_experts, layout.tp
    tokens = layout.local_batch * layout.seq_len
    norm = (8 * d + 4) / t + d * e
    attention = ((h + 2 * kv) * hd * e + (h + kv) * hd * (8 + e + 8) + h * hd * e + 4 * h) / t
    ffn = {True: experts * (e + 4) + k * (4 * d * e + 4 * i * e), False: 4 * args.ffn_dim * e / t}
    full = {layer: 2 * norm + attention + ffn[args.is_moe(layer)] for layer in range(args.n_layers)}
    grads = {layer: (max(4 * k * i, 2 * args.ffn_dim / t) + 2 * d) * e for layer in range(args.n_layers)}
    blocks = range(args.n_layers) if layout.blocks is None else layout.blocks
    saved = [d * e / t if layout.block_ac(b) == "full" else full[b] for b in blocks]
    vocab = args.vocab_size / t if layout.loss_parallel else args.vocab_size
    final_norm = norm if layout.output else 0
    logits = vocab * e if layout.output else 0
    # fp32 log-softmax output and two fp32 gradients; loss parallel's sharded log-softmax keeps one more.
    loss = vocab * (16 if layout.loss_parallel else 12) if layout.output else 0
    last = blocks[-1] if len(blocks) else 0
    parts, peak = activation_peak(saved, full[last] + grads[last], final_norm, logits, loss, layout.output)
    if layout.ep > 1 and any(args.is_moe(b) for b in blocks):
        parts["ep all-to-all send + receive"] = 2 * k * d * e
        peak += parts["ep all-to-all send + receive"]
    out = {name: round(v * tokens) for name, v in parts.items()}
    out["peak"] = round(peak * tokens)
    out["held"] = round((sum(saved) + final_norm + logits + (vocab * 4 if layout.output else 0)) * tokens)
    # The hidden state a pipeline stage hands on (sequence-parallel under TP; the routing counts handed on
    # beside it are a few numbers per layer); only a fully checkpointed block is counted as saving it.
    out["boundary"] = round(d * e / t * tokens)
    out["input_saved"] = out["boundary"] if len(blocks) and layout.block_ac(blocks[0]) == "full" else 0
    return out
