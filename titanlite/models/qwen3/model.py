"""Qwen3 (dense): the shared decoder (`models/common/decoder.py`) with QK-norm grouped-query attention
(RMSNorm on each head's queries and keys), a head width of its own (`head_dim`, not dim / n_heads), RoPE
in Hugging Face's halves layout (`models/common/rope_halves.py`), SwiGLU, and the output projection tied
to the embedding in the small flavors.

The module tree is Llama 3's (TorchTitan's names, plus `attention.{q,k}_norm`), so the dense
tensor-parallel styles addresses it (`models/common/tensor_parallel.py`) and the HF conversion is a renaming
(`hf_adapter.py`). With `tie_embeddings` the output projection's weight is the embedding's Parameter: one
tensor, sharded, gathered, initialised and trained once under every layout (the framework keeps the tie
through parallelisation and materialisation, `parallelisms/tied_parameters.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.models.common import rope_halves
from titanlite.models.common.decoder import Decoder, DecoderBlock, InitScheme
from titanlite.models.common.feed_forward import FeedForward
from titanlite.models.common.grouped_query_attention import GroupedQueryAttention

SHAPE_KEYS = ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim", "rope_theta", "max_seq_len")
"""The fields the `model.*` config keys override (`ModelSpec.shape.keys`)."""


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 36
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    """Qwen3 sets the head width on its own (not dim / n_heads)."""
    vocab_size: int = 151936
    ffn_dim: int = 12288
    """Hidden width of the SwiGLU (HF `intermediate_size`)."""
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_seq_len: int = 40960
    tie_embeddings: bool = False
    """The output projection reuses the embedding's weight (HF `tie_word_embeddings`)."""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """The SwiGLU width under the dense decoder's name (`models/common/dense_activations.py`)."""
        return self.ffn_dim

    def num_params(self, exclude_embedding: bool = False) -> int:
        d, hd, v = self.dim, self.head_dim, self.vocab_size
        block = d * hd * (2 * self.n_heads + 2 * self.kv_heads) + 2 * hd + 3 * d * self.ffn_dim + 2 * d
        total = self.n_layers * block + d + v * d + (0 if self.tie_embeddings else v * d)
        return total - (v * d if exclude_embedding else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N for the matmuls plus the attention scores (as in the PaLM paper);
        a tied output projection still runs its matmul, so it counts."""
        n = self.num_params(exclude_embedding=True) + (self.vocab_size * self.dim if self.tie_embeddings else 0)
        return 6 * n + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len


class Transformer(Decoder):
    """Qwen3 (module docstring): tokens [b, s] -> logits [b, s, vocab] (`Decoder.forward`). A tied
    embedding is the output projection too: drawn as transformers draws Qwen3's (std 0.02,
    `initializer_range`), since each token's logit for itself starts at dim x std (std 1 would make it dim)."""

    def __init__(self, args: ModelArgs, seq_len: int | None = None):
        rope = rope_halves.rope(args.head_dim, args.rope_theta)

        def block(layer: int) -> DecoderBlock:
            a = args
            attention = GroupedQueryAttention(a.dim, a.n_heads, a.kv_heads, a.head_dim, rope.rotate, a.norm_eps)
            return DecoderBlock(attention, FeedForward(a.dim, a.ffn_dim), a.dim, a.norm_eps)

        init = InitScheme(embedding_std=0.02 if args.tie_embeddings else 1.0)
        super().__init__(args, seq_len, block, rope, init, tie_embeddings=args.tie_embeddings)
