"""RoPE in Hugging Face's layout, as the Qwen3 families use it: channel i of each head turns with channel
i + head_dim / 2 (`rotate_half`), so HF's q/k projections load unpermuted. (Llama 3 rotates interleaved
pairs, Meta's layout, and permutes on conversion: `models/llama3/`.)

The tables hold each angle twice, [.., head_dim]: the half-width frequencies for both halves."""

from __future__ import annotations

from functools import partial

import torch

from titanlite.models.common.decoder import RoPE


def rope_freqs(head_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """The per-pair frequencies [head_dim // 2] in float64."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))


def _cos_sin(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().float(), angles.sin().float()


def rope_tables(
    head_dim: int, theta: float, seq_len: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [seq_len, head_dim] for positions 0 .. seq_len - 1."""
    positions = torch.arange(seq_len, device=device, dtype=torch.float64)
    return _cos_sin(torch.outer(positions, rope_freqs(head_dim, theta, device)))


def rope_at(head_dim: int, theta: float, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [b, s, head_dim] of each token's own position (`positions` [b, s]); position p gets exactly
    row p of `rope_tables`."""
    return _cos_sin(positions.to(torch.float64)[..., None] * rope_freqs(head_dim, theta, positions.device))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [b, s, h, d] by the position's angle in fp32: `cos`/`sin` are a table [>= s, d] (positions
    0 .. s - 1) or per token [b, s, d] (`rope_at`)."""
    if cos.dim() == 3:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    else:
        cos, sin = cos[None, : x.shape[1], None, :], sin[None, : x.shape[1], None, :]
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat((-x2, x1), dim=-1) * sin).type_as(x)


def rope(head_dim: int, theta: float) -> RoPE:
    """This layout's RoPE as the decoder takes it (`decoder.RoPE`)."""
    return RoPE(tables=partial(rope_tables, head_dim, theta), at=partial(rope_at, head_dim, theta), rotate=apply_rope)
