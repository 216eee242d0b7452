"""Llama 3: the shared decoder (`models/common/decoder.py`) with grouped-query attention, RoPE in Meta's
interleaved-pair layout with optional Llama 3.1 frequency scaling (`rope.py`), and SwiGLU.

The module tree and parameter names are TorchTitan's (`tok_embeddings`, `layers.{i}.attention.wq`,
`feed_forward.w1`, `norm`, `output`), which the tensor-parallel styles and the Hugging Face converter address
(it permutes q/k weights between RoPE layouts). Initialisation is TorchTitan's, the residual projections
scaled by layer depth or, without `depth_init`, by the layer count.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

from titanlite.models.common.decoder import Decoder, DecoderBlock, InitScheme, RoPE
from titanlite.models.common.feed_forward import FeedForward
from titanlite.models.common.grouped_query_attention import GroupedQueryAttention
from titanlite.models.common.rope_pairs import apply_rope
from titanlite.models.llama3.rope import rope_at, rope_tables

SHAPE_KEYS = ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim", "ffn_dim_multiplier", "rope_theta", "max_seq_len")
"""The fields the `model.*` config keys override (`ModelSpec.shape.keys`)."""


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 128256
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    ffn_dim: int | None = None
    """The feed-forward hidden width exactly (a shape override); None = from dim, the multiplier, multiple_of."""
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    use_scaled_rope: bool = False
    """Llama 3.1's long-context RoPE frequency scaling, with the four constants below (Hugging Face's
    `rope_scaling` of type "llama3"): 3.1 uses factor 8, 3.2 (1B, 3B) factor 32."""
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    max_seq_len: int = 8192
    """The longest sequence the flavor supports; RoPE tables are built for the training seq_len."""
    tie_embeddings: bool = False
    depth_init: bool = True
    """Scale output-projection init by layer depth (TorchTitan's default) instead of by layer count."""

    def shape_value(self, key: str) -> Any:
        """A shape key's value as built (`ModelSpec.resolved_shape`): unset head and width fields derive
        theirs (None in a flavor means "derived")."""
        derived = {"n_kv_heads": self.kv_heads, "ffn_dim": self.ffn_hidden_dim}
        return derived[key] if key in derived else getattr(self, key)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        if self.ffn_dim:
            return self.ffn_dim
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def num_params(self, exclude_embedding: bool = False) -> int:
        d, h, kv, hd, f, v = self.dim, self.n_heads, self.kv_heads, self.head_dim, self.ffn_hidden_dim, self.vocab_size
        block = d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * f + 2 * d
        total = self.n_layers * block + d + v * d + (0 if self.tie_embeddings else v * d)
        return total - (v * d if exclude_embedding else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N for the matmuls plus the attention scores (as in the PaLM paper)."""
        n = self.num_params(exclude_embedding=True)
        return 6 * n + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len


def attention(args: ModelArgs) -> GroupedQueryAttention:
    """Llama 3's attention: grouped-query, RoPE in interleaved pairs, no QK-norm."""
    return GroupedQueryAttention(args.dim, args.n_heads, args.kv_heads, args.head_dim, apply_rope)


class Transformer(Decoder):
    """Llama 3 (module docstring): tokens [b, s] -> logits [b, s, vocab] (`Decoder.forward`)."""

    def __init__(self, args: ModelArgs, seq_len: int | None = None):
        rope = RoPE(tables=partial(rope_tables, args), at=partial(rope_at, args), rotate=apply_rope)

        def block(layer: int) -> DecoderBlock:
            return DecoderBlock(attention(args), FeedForward(args.dim, args.ffn_hidden_dim), args.dim, args.norm_eps)

        init = InitScheme(depth_init=args.depth_init)
        super().__init__(args, seq_len, block, rope, init, tie_embeddings=args.tie_embeddings)
