"""Qwen3-MoE's activation memory per GPU, for the dry run's memory estimate (`titanlite/planning/memory.py`).

Per token of one microbatch, with the eager kernels: attention as the dense decoders'
(`models/common/dense_activations.py`) plus the q/k norms and RoPE copies; a MoE layer's router logits and
probabilities and, per routed (token, expert) pair, the gathered input, gate/up, SwiGLU and down outputs. A
MoE layer runs on the whole gathered sequence on every tp rank, so its parts are not divided by tp. Selective
AC counts as none (an upper bound). Under expert parallelism one layer's all-to-all send and receive buffers
are added to the peak; routing is planned balanced, and a rank whose experts draw f times their share holds f
times the rows. What the plan counts: docs/moe.md#dry-run.
"""

from __future__ import annotations

from titanlite.models.common.activation_peak import moe_activation_bytes
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
    last = blocks[-1] if len(blocks) else 0
    return moe_activation_bytes(args, layout, saved, full[last] + grads[last], norm, tokens)
