"""DeepSeek-V3's RoPE: the rotary part of each head (`qk_rope_head_dim` channels) in the interleaved-pair
layout of the published weights, rotated as Llama 3 rotates (`models/common/rope_pairs.py`), with YaRN's
long-context frequencies when the flavor sets `rope_scaling`.

YaRN (as Hugging Face's `rope_type="yarn"` computes it, applied at every length): the frequencies of pairs
that turn fewer than `beta_slow` times over the original context are divided by `factor`, those that turn
more than `beta_fast` times are kept, a linear ramp between; cos and sin are multiplied by the attention
factor mscale(factor, mscale) / mscale(factor, mscale_all_dim), and the attention's softmax scale by
mscale(factor, mscale_all_dim)^2 (`softmax_scale`). Tables hold one angle per pair, computed in float64."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch

from titanlite.models.common.decoder import RoPE
from titanlite.models.common.rope_pairs import apply_rope


@dataclass(frozen=True)
class YaRN:
    """YaRN's constants (Hugging Face's `rope_scaling` of type "yarn")."""

    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(factor) + 1 (1 without scaling)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_freqs(dim: int, theta: float, yarn: YaRN | None, device: torch.device | None = None) -> torch.Tensor:
    """The per-pair frequencies [dim // 2] in float64, blended by YaRN when set."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim))
    if yarn is None:
        return freqs

    def correction_dim(rotations: float) -> float:
        # The pair index whose wavelength fits `rotations` times in the original context.
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    span = (high - low) or 0.001
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float64) - low) / span).clamp(0, 1)
    return freqs / yarn.factor * ramp + freqs * (1 - ramp)


def attention_factor(yarn: YaRN | None) -> float:
    """What YaRN multiplies cos and sin by (1 without YaRN)."""
    if yarn is None:
        return 1.0
    if yarn.mscale and yarn.mscale_all_dim:
        return yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    return yarn_mscale(yarn.factor)


def softmax_scale(qk_head_dim: int, yarn: YaRN | None) -> float:
    """The attention's softmax scale: qk_head_dim^-1/2, times mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = qk_head_dim**-0.5
    if yarn is not None and yarn.mscale_all_dim:
        scale *= yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2
    return scale


def _cos_sin(angles: torch.Tensor, yarn: YaRN | None) -> tuple[torch.Tensor, torch.Tensor]:
    m = attention_factor(yarn)
    return (angles.cos() * m).float(), (angles.sin() * m).float()


def rope_tables(
    dim: int, theta: float, yarn: YaRN | None, seq_len: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [seq_len, dim // 2] for positions 0 .. seq_len - 1."""
    positions = torch.arange(seq_len, device=device, dtype=torch.float64)
    return _cos_sin(torch.outer(positions, rope_freqs(dim, theta, yarn, device)), yarn)


def rope_at(dim: int, theta: float, yarn: YaRN | None, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [b, s, dim // 2] of each token's own position; position p gets exactly row p of `rope_tables`."""
    return _cos_sin(positions.to(torch.float64)[..., None] * rope_freqs(dim, theta, yarn, positions.device), yarn)


def rope(dim: int, theta: float, yarn: YaRN | None) -> RoPE:
    """The rotary part's RoPE as the decoder takes it (`decoder.RoPE`)."""
    return RoPE(tables=partial(rope_tables, dim, theta, yarn), at=partial(rope_at, dim, theta, yarn), rotate=apply_rope)
