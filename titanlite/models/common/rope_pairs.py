"""RoPE's rotation in Meta's interleaved-pair layout (channels 2i and 2i + 1 of each head turn together), as
Llama 3 and DeepSeek-V3's rotary parts use it; each family computes its own tables, one angle per pair.
(Hugging Face's halves: `rope_halves.py`.)"""

from __future__ import annotations

import torch


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of x [b, s, h, d] by the position's angle: `cos`/`sin`
    are a table [>= s, d // 2] (positions 0 .. s - 1) or per token [b, s, d // 2] (`rope_at`)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    if cos.dim() == 3:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    else:
        cos, sin = cos[None, : x.shape[1], None, :], sin[None, : x.shape[1], None, :]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)
