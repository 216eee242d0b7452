"""A dense decoder's activation memory per GPU (Llama 3, Qwen3), for the dry run's memory estimate
(`titanlite/planning/memory.py`).

Per token of one microbatch, what autograd saves with the eager kernels, measured op by op on this model
(tests/unit/planning/test_dry_run.py): the norms' fp32 copies, q, k, v and the SDPA output, four FFN-wide tensors for
SwiGLU, the logits and the loss's fp32 buffers. Tensor parallelism divides the heads, the FFN and (with
sequence parallelism) the norms by tp; context parallelism divides every per-token part by cp and adds the
gathered keys and values. The peak is the larger of the start of backward and the last block's backward;
compiled blocks usually save less, so this is an upper bound for them. For pipeline stages it also gives the
hidden state crossing a stage boundary (`boundary`, `input_saved`). What the plan counts: docs/dry_run.md.
"""

from __future__ import annotations

from typing import Any

from titanlite.models.common.activation_peak import activation_peak
from titanlite.models.common.attention import mask_bytes
from titanlite.parallelisms.layout import Layout


def activation_bytes(args: Any, layout: Layout, qk_norm: bool = False) -> dict[str, int]:
    """Peak activation bytes of one microbatch and its parts (module docstring), and what it holds from
    its forward to its backward ("held"); `layout.blocks` and `layout.output` restrict both to a stage.
    `args`: dim, n_heads, kv_heads, head_dim, ffn_hidden_dim, vocab_size, n_layers."""
    d, h, kv, hd, f = args.dim, args.n_heads, args.kv_heads, args.head_dim, args.ffn_hidden_dim
    t = layout.tp
    e = layout.compute_dtype.itemsize
    cp = layout.cp
    tokens = layout.local_batch * layout.seq_len // cp
    # Per token. RMSNorm saves its fp32 input and normalised input (SP-sharded) and rstd; the norm output,
    # all-gathered for the projections, is saved full size.
    norm = (8 * d + 4) / t + d * e
    qkv = (h + 2 * kv) * hd * e / t
    sdpa = h * hd * e / t + 4 * h / t
    if qk_norm:  # each head's RMSNorm: its fp32 input and normalised values, rstd, its output
        sdpa += (h + kv) * (hd * (8 + e) + 4) / t
    # Under cp every batch has a mask (the rank's queries against every key): off CUDA a dense one, which
    # SDPA turns into an additive bias per block that it saves.
    mask_type = "block_causal" if cp > 1 else layout.attn_mask
    dense_bias = mask_type != "causal" and layout.device_type != "cuda"
    if cp > 1:  # gathered K/V (per local token: cp tokens' worth)
        sdpa += 2 * kv * hd * e / t * cp + (e * layout.seq_len if dense_bias else 0)
    per_block = {
        "none": 2 * norm + qkv + sdpa + 4 * f * e / t,
        "full": d * e / t,
        # Selective op, every matmul saved: the block input, every matmul output (row-parallel ones as
        # full-size partial sums, plus their reduce-scattered outputs under TP) and the SDPA outputs.
        "op_all_mm": d * e / t + qkv + sdpa + 2 * f * e / t + 2 * d * e + (2 * d * e / t if t > 1 else 0),
        # Every other matmul (wq, wv, w1, w2 saved; wk, wo, w3 recomputed).
        "op": d * e / t + (h + kv) * hd * e / t + sdpa + f * e / t + d * e + (2 * d * e / t if t > 1 else 0),
    }
    # Gradients of one block's activations while it runs backward.
    block_grads = (2 * f + d) * e / t + (d * e if t > 1 else 0)
    if cp > 1:  # the gathered keys' and values' gradients, before their reduce-scatter
        block_grads += 2 * kv * hd * e / t * cp
    vocab = args.vocab_size / t if layout.loss_parallel else args.vocab_size
    blocks = range(args.n_layers) if layout.blocks is None else layout.blocks
    saved = [per_block[layout.block_ac(i)] for i in blocks]  # AC every k-th block counts global indices
    # The last pipeline stage (or the whole model) also holds the final norm, the logits and the loss.
    final_norm = norm if layout.output else 0
    logits = vocab * e if layout.output else 0
    # fp32 log-softmax output and two fp32 gradients; loss parallel's sharded log-softmax keeps one more.
    loss = vocab * (16 if layout.loss_parallel else 12) if layout.output else 0
    parts, peak = activation_peak(saved, per_block["none"] + block_grads, final_norm, logits, loss, layout.output)
    out = {name: round(v * tokens) for name, v in parts.items()}
    q_len = layout.seq_len // cp
    mask = mask_bytes(mask_type, layout.device_type, layout.local_batch, q_len, layout.seq_len)  # type: ignore[arg-type]
    if mask:
        out["attention mask"] = mask
    out["peak"] = round(peak * tokens) + mask
    # What a microbatch keeps until its backward while a pipeline schedule runs others (PP's in flight):
    # the blocks' saved tensors and, on the last stage, the logits and the fp32 log-softmax (two under
    # loss parallel); the loss gradients exist only during its backward.
    held_loss = vocab * (8 if layout.loss_parallel else 4) if layout.output else 0
    out["held"] = round((sum(saved) + final_norm + logits + held_loss) * tokens) + mask
    # The hidden state between two blocks (sequence-parallel under TP): what a pipeline stage hands on; a
    # block under AC (full or op) saves its input as is, so a stage's first block saves what it received.
    out["boundary"] = round(d * e / t * tokens)
    out["input_saved"] = out["boundary"] if len(blocks) and layout.block_ac(blocks[0]) != "none" else 0
    return out
