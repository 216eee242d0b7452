"""Qwen3-MoE: GQA attention with RMSNorm on each head's q and k, RoPE, and decoder blocks whose feed-forward
is a mixture of experts (`models/common/moe.py`), or a dense SwiGLU in the layers `decoder_sparse_step` and
`mlp_only_layers` leave dense (Hugging Face's rule).

The module tree mirrors Hugging Face's `Qwen3MoeForCausalLM` one to one (`tok_embeddings` ->
`model.embed_tokens`, `layers.{i}.attention.{wq,wk,wv,wo,q_norm,k_norm}`, `layers.{i}.moe.{gate,experts}`
or `layers.{i}.feed_forward.{w1,w2,w3}`, `norm`, `output`). The attention is dense Qwen3's QK-norm
attention (`models/common/grouped_query_attention.py`) and RoPE rotates halves of each head as Hugging Face does
(`models/common/rope_halves.py`), so the export is a renaming (`hf_adapter.py`). The decoder around the
blocks is the MoE families' (`models/common/moe_decoder.py`).

Built on the meta device; `init_weights` fills each parameter from a stream of the seed and its name
(`models/common/init.py`) and zeroes the routing counters, so every parallel layout starts from the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titanlite.models.common import rope_halves
from titanlite.models.common.decoder import DecoderBlock, InitScheme
from titanlite.models.common.feed_forward import FeedForward
from titanlite.models.common.grouped_query_attention import GroupedQueryAttention
from titanlite.models.common.moe import MoE
from titanlite.models.common.moe_decoder import MOE_SHAPE_KEYS, MoEDecoder

SHAPE_KEYS = (*MOE_SHAPE_KEYS, "n_kv_heads")
"""The fields the `model.*` config keys override (`ModelSpec.shape.keys`)."""


@dataclass
class ModelArgs:
    dim: int = 2048
    n_layers: int = 48
    n_heads: int = 32
    n_kv_heads: int = 4
    head_dim: int = 128
    """Qwen3 sets the head width on its own (not dim / n_heads)."""
    vocab_size: int = 151936
    ffn_dim: int = 6144
    """Hidden width of the dense layers' SwiGLU (HF `intermediate_size`)."""
    moe_ffn_dim: int = 768
    """Hidden width of each expert's SwiGLU (HF `moe_intermediate_size`)."""
    num_experts: int = 128
    top_k: int = 8
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    """Layer i is a MoE layer when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers."""
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
    router_aux_loss_coef: float = 0.001
    """Weight of the load-balancing loss in the training loss (HF's `router_aux_loss_coef`)."""
    router_bias_update_rate: float = 0.0
    """Aux-loss-free balancing (DeepSeek-V3): each expert's routing bias moves by this much after every
    optimizer step, up for experts that got fewer tokens than the mean, down for more; 0: off."""
    grouped_mm: bool = True
    """Experts as grouped GEMMs (`torch._grouped_mm`) where they fit; False: a loop over the experts."""
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_seq_len: int = 40960

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    def is_moe(self, layer: int) -> bool:
        sparse = self.num_experts > 0 and (layer + 1) % self.decoder_sparse_step == 0
        return sparse and layer not in self.mlp_only_layers

    @property
    def moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.n_layers))

    def expert_params(self) -> int:
        """Parameters of every MoE layer's experts (what expert parallelism would shard)."""
        return self.moe_layers * self.num_experts * 3 * self.dim * self.moe_ffn_dim

    def num_params(self, exclude_embedding: bool = False, active: bool = False) -> int:
        """All parameters, or (`active`) those one token uses: top_k of the experts."""
        d, hd, v = self.dim, self.head_dim, self.vocab_size
        attn = d * hd * (2 * self.n_heads + 2 * self.kv_heads) + 2 * hd + 2 * d
        experts = self.top_k if active else self.num_experts
        moe = d * self.num_experts + experts * 3 * d * self.moe_ffn_dim
        dense = 3 * d * self.ffn_dim
        blocks = self.n_layers * attn + self.moe_layers * moe + (self.n_layers - self.moe_layers) * dense
        total = blocks + d + 2 * v * d
        return total - (v * d if exclude_embedding else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x the active parameters plus the attention scores."""
        n = self.num_params(exclude_embedding=True, active=True)
        return 6 * n + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len


class Transformer(MoEDecoder):
    """Qwen3-MoE (module docstring): tokens [b, s] -> logits [b, s, vocab], or a pipeline stage's hidden
    states and routing sums (`MoEDecoder.forward`)."""

    def __init__(self, args: ModelArgs, seq_len: int | None = None):
        rope = rope_halves.rope(args.head_dim, args.rope_theta)

        def block(layer: int) -> DecoderBlock:
            a = args
            attention = GroupedQueryAttention(a.dim, a.n_heads, a.kv_heads, a.head_dim, rope.rotate, a.norm_eps)
            if not a.is_moe(layer):
                return DecoderBlock(attention, FeedForward(a.dim, a.ffn_dim), a.dim, a.norm_eps, norms_first=True)
            aux_loss = a.router_aux_loss_coef > 0
            moe = MoE(a.dim, a.moe_ffn_dim, a.num_experts, a.top_k, a.norm_topk_prob, a.grouped_mm, layer, aux_loss)
            if a.router_bias_update_rate > 0:
                moe.enable_routing_bias()
            return DecoderBlock(attention, moe, a.dim, a.norm_eps, ffn_name="moe", norms_first=True)

        depth_scaled = ("attention.wo.weight", "feed_forward.w2.weight", "experts.down_proj")
        super().__init__(args, seq_len, block, rope, InitScheme(depth_scaled=depth_scaled))
