"""Qwen3 (dense): Llama 3's decoder with RMSNorm on each head's queries and keys (QK-norm), a head width of
its own (`head_dim`, not dim / n_heads), RoPE in Hugging Face's halves layout, and the output projection
tied to the embedding in the small flavors.

The module tree is Llama 3's, TorchTitan's names (`tok_embeddings`, `layers.{i}.attention.{wq,wk,wv,wo}`,
`attention.{q,k}_norm`, `feed_forward.{w1,w2,w3}`, `attention_norm`, `ffn_norm`, `norm`, `output`), so the
dense tensor-parallel plan addresses it (`models/common/tensor_parallel.py`). The attention is the QK-norm
attention Qwen3-MoE shares (`models/common/qk_norm_attention.py`); RoPE rotates halves as HF does
(`models/common/rope_halves.py`), so the HF conversion is a renaming (`hf_adapter.py`).

With `tie_embeddings` the output projection's weight is the embedding's Parameter: one tensor, sharded,
gathered, initialised and trained once under every layout (the framework keeps the tie through
parallelisation and materialisation, `parallelisms/tied_parameters.py`).

Built on the meta device; `init_weights` fills each parameter from a stream of the seed and its name
(`models/common/init.py`), so every parallel layout starts from the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from titanlite.models.common.attention import Mask
from titanlite.models.common.feed_forward import FeedForward
from titanlite.models.common.init import InitSpec, init_parameters_
from titanlite.models.common.kv_cache import KVCache, LayerKV
from titanlite.models.common.norm import RMSNorm
from titanlite.models.common.qk_norm_attention import QKNormAttention
from titanlite.models.common.rope_halves import rope_at, rope_tables
from titanlite.models.common.rope_rows import rope_rows
from titanlite.parallelisms.context_parallel.unit import SequenceShard

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


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.attention = QKNormAttention(args.dim, args.n_heads, args.kv_heads, args.head_dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Mask = None, kv: LayerKV | None = None
    ) -> torch.Tensor:
        # The KV cache only when generating: the tensor-parallel plan declares the layouts of (x, cos, sin, mask).
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, *([kv] if kv is not None else []))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    context_parallel: SequenceShard | None = None
    """As on Llama 3's model: a pipeline stage under context parallelism builds its causal mask itself."""

    def __init__(self, args: ModelArgs, seq_len: int | None = None):
        super().__init__()
        self.args = args
        self.seq_len = seq_len or args.max_seq_len
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(args.head_dim, args.rope_theta, self.seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
        mask: Mask = None,
    ) -> torch.Tensor:
        """tokens [b, s] -> logits [b, s, vocab], with the same contract as Llama 3's forward
        (`models/llama3/model.py`): pipeline stages, a KV `cache` for generation, per-document `positions`
        and the batch's `mask`, and a stage's own causal mask under context parallelism."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        a = self.args
        cos, sin, mask, pos = rope_rows(
            (self.rope_cos, self.rope_sin),
            h,
            tokens.shape[1],
            cache=cache,
            positions=positions,
            mask=mask,
            cp=self.context_parallel,
            seq_len=self.seq_len,
            at=lambda p: rope_at(a.head_dim, a.rope_theta, p),
        )
        for i, layer in enumerate(self.layers.values()):
            h = layer(h, cos, sin, mask) if cache is None else layer(h, cos, sin, None, (cache.k[i], cache.v[i], pos))
        return self.output(self.norm(h)) if self.output is not None else h

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty KV cache for generating up to `max_len` positions (at most the RoPE tables' length)."""
        a, length = self.args, min(max_len, self.seq_len)
        return KVCache.empty(self.tok_embeddings.weight, len(self.layers), batch, a.kv_heads, length, a.head_dim)

    def init_spec(self, fqn: str) -> InitSpec:
        """How the parameter named `fqn` is initialised (TorchTitan's scheme). A tied embedding is the
        output projection too: drawn as transformers draws Qwen3's (std 0.02, `initializer_range`), since
        each token's logit for itself starts at dim x std (std 1 would make it dim)."""
        a = self.args
        if fqn.startswith("tok_embeddings."):
            return InitSpec("normal", std=0.02 if a.tie_embeddings else 1.0)
        if fqn.startswith("output."):
            std = a.dim**-0.5
            return InitSpec("trunc_normal", std=std, cutoff=3 * std)
        if fqn.endswith("norm.weight"):
            return InitSpec("ones")
        if fqn.endswith(("attention.wo.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")):
            depth = int(fqn.split(".")[1]) + 1
            return InitSpec("trunc_normal", std=0.02 / (2 * depth) ** 0.5)
        return InitSpec("trunc_normal", std=0.02)

    @torch.no_grad()
    def init_weights(self, seed: int, buffer_device: torch.device | None = None) -> None:
        """Fill every parameter (sharded or not, a tied one once) and rebuild the RoPE tables."""
        init_parameters_([(fqn, p, self.init_spec(fqn)) for fqn, p in self.named_parameters()], seed)
        device = buffer_device or self.rope_cos.device
        self.rope_cos, self.rope_sin = rope_tables(self.args.head_dim, self.args.rope_theta, self.seq_len, device)
