"""DeepSeek-V3: multi-head latent attention (`attention.py`) with a decoupled rotary part and YaRN
(`rope.py`), and DeepSeekMoE feed-forwards (`moe.py`) after `first_k_dense_replace` dense SwiGLU layers.

The module tree is TorchTitan's (`tok_embeddings`, `layers.{i}.attention.{wq | wq_a, q_norm, wq_b; wkv_a,
kv_norm, wkv_b, wo}`, `layers.{i}.feed_forward.{w1,w2,w3}` or `layers.{i}.moe.{gate, expert_bias, experts,
shared_experts}`, `norm`, `output`, never tied), which the tensor-parallel styles (`parallelize.py`) and the
HF adapter address. The decoder, its pipeline routing hand-off and its KV cache are the shared ones
(`models/common/decoder.py`, `models/common/moe_decoder.py`). Multi-token prediction is not built.

Built on the meta device; `init_weights` fills each parameter from a stream of the seed and its name
(`models/common/init.py`) and zeroes the balancing bias and the routing counters.
"""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.models.common.decoder import DecoderBlock, InitScheme
from titanlite.models.common.feed_forward import FeedForward
from titanlite.models.common.kv_cache import KVCache
from titanlite.models.common.moe_decoder import MOE_SHAPE_KEYS, MoEDecoder
from titanlite.models.deepseek_v3.attention import MultiHeadLatentAttention
from titanlite.models.deepseek_v3.moe import DeepSeekMoE, ScoreFunc
from titanlite.models.deepseek_v3.rope import YaRN, rope, softmax_scale

SHAPE_KEYS = MOE_SHAPE_KEYS
"""The fields the `model.*` config keys override (`ModelSpec.shape.keys`): the MoE families', no key/value
heads (every head has its own, expanded from the latent)."""


@dataclass
class ModelArgs:
    """DeepSeek-V3's shape; Hugging Face `DeepseekV3Config` names in brackets where they differ."""

    dim: int = 7168
    """[hidden_size]"""
    n_layers: int = 61
    """[num_hidden_layers]"""
    n_heads: int = 128
    """[num_attention_heads]"""
    vocab_size: int = 129280
    ffn_dim: int = 18432
    """Hidden width of the dense layers' SwiGLU [intermediate_size]."""
    moe_ffn_dim: int = 2048
    """Hidden width of each expert's SwiGLU [moe_intermediate_size]."""
    q_lora_rank: int = 1536
    """The queries' latent width; 0: queries projected directly (`wq`) [HF None]."""
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    num_experts: int = 256
    """Routed experts per MoE layer [n_routed_experts]."""
    n_shared_experts: int = 1
    top_k: int = 8
    """[num_experts_per_tok]"""
    first_k_dense_replace: int = 3
    """The first layers keep a dense SwiGLU."""
    n_group: int = 8
    """Expert groups of the group-limited routing (1: none)."""
    topk_group: int = 4
    """Groups each token's experts may come from."""
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    score_func: ScoreFunc = "sigmoid"
    router_bias_update_rate: float = 0.001
    """Aux-loss-free balancing: each expert's routing bias moves by this much after every optimizer step,
    up for experts that got fewer tokens than the mean, down for more; 0: the bias stays as loaded."""
    router_aux_loss_coef: float = 0.0
    """Weight of the load-balancing loss over the normalised scores (`models/common/moe_balance.py`); 0: none."""
    grouped_mm: bool = True
    """Experts as grouped GEMMs (`torch._grouped_mm`) where they fit; False: a loop over the experts."""
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_seq_len: int = 163840
    """[max_position_embeddings]"""
    rope_scaling: YaRN | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def head_dim(self) -> int:
        """The attention's key width (the decoder's protocol)."""
        return self.qk_head_dim

    @property
    def kv_heads(self) -> int:
        """Every query head has its own key and value (expanded from the shared latent)."""
        return self.n_heads

    def is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and layer >= self.first_k_dense_replace

    @property
    def moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.n_layers))

    def expert_params(self) -> int:
        """Parameters of every MoE layer's routed experts (what expert parallelism would shard)."""
        return self.moe_layers * self.num_experts * 3 * self.dim * self.moe_ffn_dim

    def attention_params(self) -> int:
        """One layer's latent attention, its norms included."""
        d, h, q = self.dim, self.n_heads, self.q_lora_rank
        query = d * h * self.qk_head_dim if q == 0 else d * q + q + q * h * self.qk_head_dim
        kv = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv += self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
        return query + kv + h * self.v_head_dim * d

    def num_params(self, exclude_embedding: bool = False, active: bool = False) -> int:
        """All parameters, or (`active`) those one token uses: top_k of the routed experts."""
        d, v = self.dim, self.vocab_size
        experts = self.top_k if active else self.num_experts
        moe = d * self.num_experts + (experts + self.n_shared_experts) * 3 * d * self.moe_ffn_dim
        dense = 3 * d * self.ffn_dim
        blocks = self.n_layers * (self.attention_params() + 2 * d)
        blocks += self.moe_layers * moe + (self.n_layers - self.moe_layers) * dense
        total = blocks + d + 2 * v * d
        return total - (v * d if exclude_embedding else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x the active parameters plus the attention scores (q.k over
        qk_head_dim, the weighted sum over v_head_dim)."""
        n = self.num_params(exclude_embedding=True, active=True)
        return 6 * n + 6 * self.n_layers * self.n_heads * (self.qk_head_dim + self.v_head_dim) * seq_len


class Transformer(MoEDecoder):
    """DeepSeek-V3 (module docstring): tokens [b, s] -> logits [b, s, vocab], or a pipeline stage's hidden
    states and routing sums (`MoEDecoder.forward`)."""

    def __init__(self, args: ModelArgs, seq_len: int | None = None):
        a = args
        rotary = rope(a.qk_rope_head_dim, a.rope_theta, a.rope_scaling)
        scale = softmax_scale(a.qk_head_dim, a.rope_scaling)

        def block(layer: int) -> DecoderBlock:
            attention = MultiHeadLatentAttention(
                a.dim,
                a.n_heads,
                a.q_lora_rank,
                a.kv_lora_rank,
                a.qk_nope_head_dim,
                a.qk_rope_head_dim,
                a.v_head_dim,
                rotary.rotate,
                scale,
                a.norm_eps,
            )
            if not a.is_moe(layer):
                return DecoderBlock(attention, FeedForward(a.dim, a.ffn_dim), a.dim, a.norm_eps, norms_first=True)
            moe = DeepSeekMoE(
                a.dim,
                a.moe_ffn_dim,
                a.num_experts,
                a.top_k,
                n_shared_experts=a.n_shared_experts,
                score_func=a.score_func,
                n_group=a.n_group,
                topk_group=a.topk_group,
                routed_scaling_factor=a.routed_scaling_factor,
                norm_topk_prob=a.norm_topk_prob,
                grouped=a.grouped_mm,
                count_steps=a.router_bias_update_rate > 0,
                layer_id=layer,
                aux_loss=a.router_aux_loss_coef > 0,
            )
            return DecoderBlock(attention, moe, a.dim, a.norm_eps, ffn_name="moe", norms_first=True)

        depth_scaled = (
            "attention.wo.weight",
            "feed_forward.w2.weight",
            "experts.down_proj",
            "shared_experts.w2.weight",
        )
        super().__init__(args, seq_len, block, rotary, InitScheme(depth_scaled=depth_scaled))

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty KV cache for generating up to `max_len` positions: keys qk_head_dim wide, values
        v_head_dim."""
        a, length = self.args, min(max_len, self.seq_len)
        like = self.tok_embeddings.weight
        return KVCache.empty(like, len(self.layers), batch, a.n_heads, length, a.qk_head_dim, a.v_head_dim)
