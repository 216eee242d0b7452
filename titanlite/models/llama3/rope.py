"""Llama 3's RoPE: Meta's interleaved-pair layout (channels 2i and 2i + 1 of each head turn together),
with Llama 3.1's long-context frequency scaling when the flavor enables it (`ModelArgs.use_scaled_rope`).
The Hugging Face converter permutes q/k weights between this layout and HF's halves (`hf_adapter.py`).

The tables hold one angle per pair, [.., head_dim // 2], computed in float64 and stored in float32; the
rotation is the shared one of interleaved pairs (`models/common/rope_pairs.py`)."""

from __future__ import annotations

import math
from typing import Protocol

import torch


class RopeArgs(Protocol):
    """The fields of Llama 3's `ModelArgs` its RoPE reads."""

    rope_theta: float
    use_scaled_rope: bool
    rope_scaling_factor: float
    rope_low_freq_factor: float
    rope_high_freq_factor: float
    rope_original_max_seq_len: int

    @property
    def head_dim(self) -> int: ...


def rope_freqs(args: RopeArgs, device: torch.device | None = None) -> torch.Tensor:
    """RoPE's per-pair frequencies [head_dim // 2] in float64, with Llama 3.1 long-context scaling if enabled."""
    hd = args.head_dim
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float64) / hd))
    if args.use_scaled_rope:
        freqs = _scale_freqs(
            freqs,
            factor=args.rope_scaling_factor,
            low=args.rope_low_freq_factor,
            high=args.rope_high_freq_factor,
            old_ctx=args.rope_original_max_seq_len,
        )
    return freqs


def rope_tables(args: RopeArgs, seq_len: int, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape [seq_len, head_dim // 2] for positions 0 .. seq_len - 1."""
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float64), rope_freqs(args, device))
    return angles.cos().float(), angles.sin().float()


def rope_at(args: RopeArgs, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [b, s, head_dim // 2] of each token's own position (`positions` [b, s], which restart at
    each document under block_causal and may exceed the sequence length); position p gets exactly the
    values of row p of `rope_tables`."""
    angles = positions.to(torch.float64)[..., None] * rope_freqs(args, positions.device)
    return angles.cos().float(), angles.sin().float()


def _scale_freqs(freqs: torch.Tensor, factor: float = 8.0, low: float = 1.0, high: float = 4.0, old_ctx: int = 8192):
    """Llama 3.1's frequency scaling: long wavelengths are slowed by `factor`, short ones kept, smooth between."""
    wavelen = 2 * math.pi / freqs
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_ctx / low, freqs / factor, freqs)
    mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return torch.where(mid, (1 - smooth) * freqs / factor + smooth * freqs, scaled)
