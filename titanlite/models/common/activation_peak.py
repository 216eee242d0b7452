"""The activation peak of one step, shared by the model families' activation models
(`models/common/dense_activations.py`, `models/qwen3_moe/activations.py`, `models/deepseek_v3/activations.py`):
the larger of the start of backward and the last block's backward, with its parts by name for the dry run's
table; and a MoE family's whole estimate from its blocks' bytes (`moe_activation_bytes`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def activation_peak(
    saved: Sequence[float], last_block: float, final_norm: float, logits: float, loss: float, output: bool
) -> tuple[dict[str, float], float]:
    """The activation peak of one step, per token, shared by the families' activation models: at the start
    of backward (every block's saved tensors, and on the stage that has the output the final norm, the
    logits and the loss) or in the last block's backward (its recomputed forward and gradients, `last_block`,
    beside the other blocks' saved tensors and the logits), whichever is higher; with its parts by name."""
    start_of_backward = sum(saved) + final_norm + logits + loss
    last_block_backward = sum(saved[:-1]) + last_block + logits
    parts: dict[str, float] = {f"saved by {len(saved)} blocks": sum(saved)}
    if output:
        parts |= {"final norm + output input": final_norm, "logits + fp32 loss": logits + loss}
    if last_block_backward > start_of_backward:
        parts = {
            f"saved by {len(saved) - 1} blocks": sum(saved[:-1]),
            "last block in backward (recomputed + grads)": last_block,
        }
        if output:
            parts["logits"] = logits
    return parts, max(start_of_backward, last_block_backward)


def moe_activation_bytes(
    args: Any, layout: Any, kept: Sequence[float], last_block: float, norm: float, tokens: int
) -> dict[str, int]:
    """A MoE family's activation bytes of one microbatch of `tokens` tokens from its blocks' (`kept`: what each
    block of `layout.blocks` holds to its backward, per token; `last_block`: the last one's recomputed forward
    and gradients; `norm`: a norm's bytes): the parts, "peak", what it holds from its forward to its backward
    ("held"), the hidden state a pipeline stage hands on ("boundary", sequence-parallel under TP) and whether
    a fully checkpointed first block saves it ("input_saved"). The output, its fp32 loss and, under expert
    parallelism, one layer's all-to-all send and receive buffers are added here."""
    d, e, t = args.dim, layout.compute_dtype.itemsize, layout.tp
    blocks = range(args.n_layers) if layout.blocks is None else layout.blocks
    vocab = args.vocab_size / t if layout.loss_parallel else args.vocab_size
    final_norm = norm if layout.output else 0
    logits = vocab * e if layout.output else 0
    # fp32 log-softmax output and two fp32 gradients; loss parallel's sharded log-softmax keeps one more.
    loss = vocab * (16 if layout.loss_parallel else 12) if layout.output else 0
    parts, peak = activation_peak(kept, last_block, final_norm, logits, loss, layout.output)
    if layout.ep > 1 and any(args.is_moe(b) for b in blocks):
        parts["ep all-to-all send + receive"] = 2 * args.top_k * d * e
        peak += parts["ep all-to-all send + receive"]
    out = {name: round(v * tokens) for name, v in parts.items()}
    out["peak"] = round(peak * tokens)
    out["held"] = round((sum(kept) + final_norm + logits + (vocab * 4 if layout.output else 0)) * tokens)
    out["boundary"] = round(d * e / t * tokens)
    out["input_saved"] = out["boundary"] if len(blocks) and layout.block_ac(blocks[0]) == "full" else 0
    return out
