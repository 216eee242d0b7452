"""The activation peak of one step, shared by the model families' activation models
(`models/common/dense_activations.py`, `models/qwen3_moe/activations.py`): the larger of the start of
backward and the last block's backward, with its parts by name for the dry run's table."""

from __future__ import annotations

from collections.abc import Sequence


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
