"""DeepSeek-V3's activation memory per GPU, for the dry run's memory estimate (`titanlite/planning/memory.py`). Per
token of one microbatch, what autograd saves with the eager kernels, measured tensor by tensor on the debug model
(tests/unit/planning/test_deepseek_v3_plan.py). Multi-head latent attention: the latents' RMSNorms (their fp32
inputs), the queries and the keys/values as attention takes them (qk_head_dim and v_head_dim per head) and its
output; on CUDA the memory-efficient kernel (the head dims differ, which flash attention refuses) saves its
logsumexp, elsewhere the math kernel saves the scores' probabilities. DeepSeekMoE: the router's fp32 scores and its
choice's indices, per routed (token, expert) row the gathered input, gate/up, SwiGLU input and weighted output, and
the shared experts' SwiGLU; dense layers: their SwiGLU. Tensor parallelism divides the heads, the dense SwiGLU and
the shared experts (latents replicated; routing and routed experts run whole on every tp rank); context parallelism
divides the tokens and adds the gathered keys and values. Selective AC counts as none (an upper bound). Under full
AC a fully checkpointed block keeps its input; with the optional auxiliary loss (`router_aux_loss_coef` > 0, 0 in
the flavors) a MoE block also keeps what its forward saved up to the router's scores, whose graph the router's
statistics (`RouterStats.prob_sum`) carry out of the checkpoint to the loss. Under expert parallelism one layer's
all-to-all send and receive buffers are added (balanced routing).
docs/layout_search.md#deepseek-v3.
"""

from __future__ import annotations

from typing import Any

from titanlite.models.common.activation_peak import moe_activation_bytes
from titanlite.parallelisms.layout import Layout


def rms_norm(width: float, e: int) -> float:
    """Bytes per token an eager RMSNorm of `width` saves: its fp32 input and normalised values, rstd, and
    its output in the compute dtype (saved by the projection it feeds)."""
    return 8 * width + 4 + width * e


def attention_bytes(args: Any, layout: Layout) -> float:
    """Multi-head latent attention's saved bytes per local token (module docstring)."""
    e, t, cp = layout.compute_dtype.itemsize, layout.tp, layout.cp
    h, r, kv = args.n_heads, args.qk_rope_head_dim, args.kv_lora_rank
    qk, v = args.qk_head_dim, args.v_head_dim
    latent = rms_norm(args.q_lora_rank, e) if args.q_lora_rank else 0.0
    # kv_norm's fp32 input: in fp32 the whole of wkv_a's output (the latent is a view of it), else a copy.
    latent += rms_norm(kv, e) - kv * 4 + 4 * (kv + r if e == 4 else kv)
    if layout.device_type == "cuda":  # q, the joined keys and values, the output and its logsumexp
        heads = h * qk * e + h * (qk + v) * e + h * v * e + 4 * h
    else:  # the math kernel: q and k copies, the probabilities over every key, v, the output
        heads = 2 * h * qk * e + h * layout.seq_len * e + 2 * h * v * e
    if cp > 1:  # the gathered keys and values (per local token: cp tokens' worth)
        heads += h * (qk + v) * e * cp
    return latent + heads / t


def router_bytes(args: Any, e: int) -> float:
    """The router's saved bytes per token: fp32 scores, the chosen experts' indices and weights, the groups'
    choice under group-limited routing, and in a lower-precision compute dtype the input's fp32 copy."""
    k, groups = args.top_k, args.n_group
    out = 4 * args.num_experts + 12 * k + 12 + (0 if e == 4 else 4 * args.dim)
    if groups > 1:  # the two best scores' indices per group, the kept groups' indices and mask
        out += 17 * groups + 8 * args.topk_group
    return out


def activation_bytes(args: Any, layout: Layout) -> dict[str, int]:
    """Peak activation bytes of one microbatch and its parts, and what it holds from its forward to its
    backward ("held"); `layout.blocks` and `layout.output` restrict both to a pipeline stage. `args`: the
    family's ModelArgs."""
    d, e, t = args.dim, layout.compute_dtype.itemsize, layout.tp
    k, i = args.top_k, args.moe_ffn_dim
    shared = args.n_shared_experts * i
    tokens = layout.local_batch * layout.seq_len // layout.cp
    norm = (8 * d + 4) / t + d * e
    attention = attention_bytes(args, layout)
    router = router_bytes(args, e)
    moe = router + k * (2 * d * e + 4 * i * e + 16 + e) + 4 * shared * e / t
    ffn = {True: moe, False: 4 * args.ffn_dim * e / t}
    full = {layer: 2 * norm + attention + ffn[args.is_moe(layer)] for layer in range(args.n_layers)}
    widest = {True: max(4 * k * i, 2 * shared / t) * e, False: (2 * args.ffn_dim / t + 2 * d) * e}
    grads = {layer: widest[args.is_moe(layer)] for layer in range(args.n_layers)}
    # What a fully checkpointed MoE block keeps besides its input under the auxiliary loss (module docstring):
    # its forward's saved tensors up to the router, but the block input and attention's output, not held twice.
    router_graph = 2 * norm + attention + router - 2 * d * e if args.router_aux_loss_coef > 0 else 0.0
    blocks = range(args.n_layers) if layout.blocks is None else layout.blocks

    def saved(b: int) -> float:
        if layout.block_ac(b) != "full":
            return full[b]
        return d * e / t + (router_graph if args.is_moe(b) else 0)

    kept = [saved(b) for b in blocks]
    last = blocks[-1] if len(blocks) else 0
    last_backward = full[last] + grads[last] + (kept[-1] - d * e / t if len(blocks) else 0)
    return moe_activation_bytes(args, layout, kept, last_backward, norm, tokens)
