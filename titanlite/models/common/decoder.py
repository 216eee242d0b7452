"""The decoder every family configures: a pre-norm block (`DecoderBlock`: x + attention(norm(x)), then
h + feed_forward(norm(h))) and the model around its blocks (`Decoder`: embedding, blocks, final norm,
output projection, RoPE tables, KV cache, initialisation). A family supplies its attention, its
feed-forward, its RoPE (`RoPE`) and its initialisation (`InitScheme`); Llama 3 and Qwen3 plug in the
grouped-query attention and the SwiGLU, Qwen3-MoE its mixture of experts, a latent attention or another
mixture plugs in the same way.

The module tree and parameter names are TorchTitan's (`tok_embeddings`, `layers.{i}.attention`,
`layers.{i}.feed_forward`, `attention_norm`, `ffn_norm`, `norm`, `output`), which the tensor-parallel
plans, the HF adapters and existing checkpoints address. Modules register in the order a family builds
them: the parameters' order, which the gradient norm's sums follow. Built on the meta device; each
parameter is filled from a stream of the seed and its name (`init.py`), so every layout starts alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import nn

from titanlite.models.common.attention import Mask
from titanlite.models.common.grouped_query_attention import Rotate
from titanlite.models.common.init import InitSpec, init_parameters_
from titanlite.models.common.kv_cache import KVCache, LayerKV
from titanlite.models.common.norm import RMSNorm
from titanlite.models.common.rope_rows import Rope, rope_rows
from titanlite.parallelisms.context_parallel.unit import SequenceShard

FeedForwardName = Literal["feed_forward", "moe"]
"""A block's feed-forward's name, which the tensor-parallel styles and the HF adapters address."""


class DecoderArgs(Protocol):
    """The shape fields the decoder reads of a family's `ModelArgs`."""

    dim: int
    n_layers: int
    vocab_size: int
    norm_eps: float
    max_seq_len: int

    @property
    def kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...


@dataclass(frozen=True)
class RoPE:
    """A family's rotary embedding: its tables for positions 0 .. seq_len - 1, the rows of given positions
    (`rope_rows.py`), and how it rotates a head (its layout)."""

    tables: Callable[..., Rope]
    """(seq_len, device=None) -> (cos, sin)."""
    at: Callable[[torch.Tensor], Rope]
    rotate: Rotate


@dataclass(frozen=True)
class InitScheme:
    """TorchTitan's initialisation as a family sets it: the embedding normal(0, `embedding_std`), the
    output truncated normal at dim^-1/2, norms ones, the projections into the residual (`depth_scaled`
    suffixes) 0.02 / sqrt(2 x depth), depth the layer's index + 1 (`depth_init`) or the layer count,
    every other weight 0.02."""

    depth_scaled: tuple[str, ...] = ("attention.wo.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")
    depth_init: bool = True
    embedding_std: float = 1.0


class DecoderBlock(nn.Module):
    """x + attention(attention_norm(x)), then h + ffn(ffn_norm(h)), the feed-forward registered as
    `ffn_name` (`moe`: a mixture of experts). The modules register in the order the block's parameters
    are listed (state dict, optimizer, the gradient norm's sums): attention, feed-forward, norms, or the
    feed-forward after the norms when `norms_first` (Qwen3-MoE's order)."""

    def __init__(
        self,
        attention: nn.Module,
        ffn: nn.Module,
        dim: int,
        norm_eps: float,
        ffn_name: FeedForwardName = "feed_forward",
        norms_first: bool = False,
    ):
        super().__init__()
        self.ffn_name = ffn_name
        self.attention = attention
        if not norms_first:
            self.add_module(ffn_name, ffn)
        self.attention_norm = RMSNorm(dim, norm_eps)
        self.ffn_norm = RMSNorm(dim, norm_eps)
        if norms_first:
            self.add_module(ffn_name, ffn)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Mask = None, kv: LayerKV | None = None
    ) -> torch.Tensor:
        # The KV cache only when generating: a tensor-parallel styles declares the layouts of (x, cos, sin, mask).
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, *([kv] if kv is not None else []))
        return h + getattr(self, self.ffn_name)(self.ffn_norm(h))


class Decoder(nn.Module):
    context_parallel: SequenceShard | None = None
    """Under context parallelism this rank's part of every sequence (set by the framework, as on the
    attention): a pipeline stage, which its schedule hands hidden states only, builds the causal mask
    and positions of its tokens itself (`forward`)."""

    def __init__(
        self,
        args: DecoderArgs,
        seq_len: int | None,
        block: Callable[[int], nn.Module],
        rope: RoPE,
        init: InitScheme,
        tie_embeddings: bool = False,
    ):
        super().__init__()
        self.args, self.rope, self.init_scheme = args, rope, init
        self.seq_len = seq_len or args.max_seq_len
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed "0".."n-1" keeps FQNs stable when blocks are wrapped or compiled.
        self.layers = nn.ModuleDict({str(i): block(i) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope.tables(self.seq_len)
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
        on the last (earlier ones return hidden states)."""
        h = self.hidden_states(tokens, cache, positions, mask)
        return self.output(self.norm(h)) if self.output is not None else h

    def hidden_states(
        self, tokens: torch.Tensor, cache: KVCache | None, positions: torch.Tensor | None, mask: Mask
    ) -> torch.Tensor:
        """The embedding (or the hidden states handed in) through every block held. With a `cache`
        (generation), `tokens` are the positions after the cached ones: one sequence, one document, causal.

        `positions` [b, s] (each token's position in its document) replace 0 .. s - 1 in RoPE and `mask`
        (`attention.py`, built once per batch by the caller, outside any compiled code) replaces causal
        attention in every block; without them the model is causal over the whole row. Under context
        parallelism without them (a pipeline stage, whose rows are `seq_len` tokens) the tokens are this
        rank's part of every row: RoPE takes their global indices and every block the causal mask of
        their queries against every key (`rope_rows.py`; flex attention's BlockMask on CUDA, never a
        dense mask, which sends grouped-query attention to SDPA's math kernel)."""
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
            at=self.rope.at,
        )
        for i, layer in enumerate(self.layers.values()):
            h = layer(h, cos, sin, mask) if cache is None else layer(h, cos, sin, None, (cache.k[i], cache.v[i], pos))
        return h

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty KV cache for generating up to `max_len` positions (at most the RoPE tables' length)."""
        a, length = self.args, min(max_len, self.seq_len)
        return KVCache.empty(self.tok_embeddings.weight, len(self.layers), batch, a.kv_heads, length, a.head_dim)

    def init_spec(self, fqn: str) -> InitSpec:
        """How the parameter named `fqn` is initialised (`InitScheme`)."""
        a, init = self.args, self.init_scheme
        if fqn.startswith("tok_embeddings."):
            return InitSpec("normal", std=init.embedding_std)
        if fqn.startswith("output."):
            std = a.dim**-0.5
            return InitSpec("trunc_normal", std=std, cutoff=3 * std)
        if fqn.endswith("norm.weight"):
            return InitSpec("ones")
        if fqn.endswith(init.depth_scaled):
            depth = int(fqn.split(".")[1]) + 1 if init.depth_init else a.n_layers
            return InitSpec("trunc_normal", std=0.02 / (2 * depth) ** 0.5)
        return InitSpec("trunc_normal", std=0.02)

    @torch.no_grad()
    def init_weights(self, seed: int, buffer_device: torch.device | None = None) -> None:
        """Fill every parameter (sharded or not, a tied one once) deterministically and rebuild the RoPE
        tables."""
        init_parameters_([(fqn, p, self.init_spec(fqn)) for fqn, p in self.named_parameters()], seed)
        self.rope_cos, self.rope_sin = self.rope.tables(self.seq_len, buffer_device or self.rope_cos.device)
