"""Llama 3: RMSNorm, RoPE (with optional Llama 3.1 frequency scaling), GQA attention, SwiGLU.

The module tree and parameter names follow TorchTitan (`tok_embeddings`, `layers.{i}.attention.wq`,
`feed_forward.w1`, `norm`, `output`) so that parallelize plans and checkpoint converters can address
parameters by FQN. RoPE uses Meta's interleaved-pair convention; the Hugging Face converter permutes
q/k weights accordingly.

The model is built on the meta device and initialised with `init_weights` after materialisation. Each
parameter is filled from a stream that depends only on the seed and the parameter's name, and each rank
fills only the block it holds, so the initial weights are identical for every parallel layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from titanlite.models.common.attention import Mask
from titanlite.models.common.feed_forward import FeedForward
from titanlite.models.common.init import InitSpec, init_parameters_
from titanlite.models.common.kv_cache import KVCache, LayerKV, attend_cached
from titanlite.models.common.norm import RMSNorm
from titanlite.models.common.rope_rows import rope_rows
from titanlite.parallelisms.context_parallel.unit import SequenceShard

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


def rope_freqs(args: ModelArgs, device: torch.device | None = None) -> torch.Tensor:
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


def rope_tables(args: ModelArgs, seq_len: int, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape [seq_len, head_dim // 2] for positions 0 .. seq_len - 1."""
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float64), rope_freqs(args, device))
    return angles.cos().float(), angles.sin().float()


def rope_at(args: ModelArgs, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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


class Attention(nn.Module):
    context_parallel: SequenceShard | None = None
    """Under context parallelism this rank's part of every sequence (set by the framework): the input
    holds some tokens of each sequence and the keys and values of all are gathered; the mask is that of
    the rank's queries against every key, built once per batch outside the blocks (by the step,
    `step.model_forward`, or by a pipeline stage's forward, `Transformer.forward`)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Mask = None, kv: LayerKV | None = None
    ) -> torch.Tensor:
        bsz, seq, _ = x.shape

        def heads(w: nn.Linear) -> torch.Tensor:
            # Under tensor parallelism the projections hold a slice of the heads: infer the local count.
            return w(x).view(bsz, seq, -1, self.head_dim)

        cp = self.context_parallel if kv is None else None
        if cp is None:
            # Queries first: the order of the projections is the order autograd sums their gradients into
            # x's, so reordering them changes every run's losses in their last bits.
            q, k, v = heads(self.wq), heads(self.wk), heads(self.wv)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:
            if mask is None:
                raise ValueError("attention under context parallelism takes the mask of its queries (causal_mask)")
            k, v = heads(self.wk), heads(self.wv)
            k = apply_rope(k, cos, sin)
            # The keys and values are gathered while the queries are projected (`start_gather`).
            pending = cp.start_gather(torch.stack((k, v)), dim=2)
            q = apply_rope(heads(self.wq), cos, sin)
            k, v = cp.finish_gather(pending, dim=2).unbind(0)
        return self.wo(attend_cached(q, k, v, mask, kv))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Mask = None, kv: LayerKV | None = None
    ) -> torch.Tensor:
        # The KV cache only when generating: a tensor-parallel plan declares the layouts of (x, cos, sin, mask).
        attend = self.attention(self.attention_norm(x), cos, sin, mask, *([kv] if kv is not None else []))
        h = x + attend
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    context_parallel: SequenceShard | None = None
    """Under context parallelism this rank's part of every sequence (set by the framework, as on
    `Attention`): a pipeline stage, which its schedule hands hidden states only, builds the causal mask
    and positions of its tokens itself (`forward`)."""

    def __init__(self, args: ModelArgs, seq_len: int | None = None):
        super().__init__()
        self.args = args
        self.seq_len = seq_len or args.max_seq_len
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed "0".."n-1" keeps FQNs stable when blocks are wrapped or compiled.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(args, self.seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
        mask: Mask = None,
    ) -> torch.Tensor:
        """tokens [b, s] -> logits [b, s, vocab]. A pipeline stage holds some blocks only, the embedding
        on the first stage (later ones take the previous stage's hidden states) and the norm and output
        on the last (earlier ones return hidden states). With a `cache` (generation), `tokens` are the
        positions after the cached ones: one sequence, one document, causal.

        `positions` [b, s] (each token's position in its document) replace 0 .. s - 1 in RoPE and `mask`
        (`models/common/attention.py`, built once per batch by the caller, outside any compiled code) replaces
        causal attention in every block; without them the model is causal over the whole row. Under
        context parallelism without them (a pipeline stage, whose rows are `seq_len` tokens: the plan
        refuses validation under pipeline parallelism) the tokens are this rank's part of every row: RoPE
        takes their global indices and every block the causal mask of their queries against every key,
        built once per microbatch as the step builds it without stages (`models/common/rope_rows.py`;
        flex attention's BlockMask on CUDA, never a dense mask, which sends grouped-query attention to
        SDPA's math kernel)."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        cos, sin, mask, pos = rope_rows(
            (self.rope_cos, self.rope_sin),
            h,
            tokens.shape[1],
            cache=cache,
            positions=positions,
            mask=mask,
            cp=self.context_parallel,
            seq_len=self.seq_len,
            at=lambda p: rope_at(self.args, p),
        )
        for i, layer in enumerate(self.layers.values()):
            h = layer(h, cos, sin, mask) if cache is None else layer(h, cos, sin, None, (cache.k[i], cache.v[i], pos))
        return self.output(self.norm(h)) if self.output is not None else h

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty KV cache for generating up to `max_len` positions (at most the RoPE tables' length)."""
        a, length = self.args, min(max_len, self.seq_len)
        return KVCache.empty(self.tok_embeddings.weight, len(self.layers), batch, a.kv_heads, length, a.head_dim)

    def init_spec(self, fqn: str) -> InitSpec:
        """How the parameter named `fqn` is initialised (TorchTitan's scheme)."""
        a = self.args
        if fqn.startswith("tok_embeddings."):
            return InitSpec("normal", std=1.0)
        if fqn.startswith("output."):
            std = a.dim**-0.5
            return InitSpec("trunc_normal", std=std, cutoff=3 * std)
        if fqn.endswith("norm.weight"):
            return InitSpec("ones")
        if fqn.endswith(("attention.wo.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")):
            layer_id = int(fqn.split(".")[1])
            depth = layer_id + 1 if a.depth_init else a.n_layers
            return InitSpec("trunc_normal", std=0.02 / (2 * depth) ** 0.5)
        return InitSpec("trunc_normal", std=0.02)

    @torch.no_grad()
    def init_weights(self, seed: int, buffer_device: torch.device | None = None) -> None:
        """Fill every parameter (sharded or not) deterministically and rebuild the RoPE tables."""
        init_parameters_([(fqn, p, self.init_spec(fqn)) for fqn, p in self.named_parameters()], seed)
        cos, sin = rope_tables(self.args, self.seq_len, device=buffer_device or self.rope_cos.device)
        self.rope_cos, self.rope_sin = cos, sin
