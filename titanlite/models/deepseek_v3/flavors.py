"""DeepSeek-V3 flavors: a CPU-sized debug model and published shapes.

`16B` has the shapes of DeepSeek-V2-Lite (and Moonlight-16B-A3B): 27 layers of width 2048, the first dense,
64 routed experts (6 per token) and 2 shared, no query latent, softmax scores, YaRN factor 40 with mscale
0.707 over 4,096 original positions. `671B` is DeepSeek-V3's published `config.json`: 61 layers of width 7168,
the first 3 dense, 256 routed experts in 8 groups (8 per token from 4 groups) and 1 shared, sigmoid scores
scaled by 2.5, a 1536-wide query latent, YaRN factor 40 over 4,096 original positions, 163,840 positions.
Both balance the experts without an auxiliary loss (the bias moves 0.001 per step).
"""

from titanlite.models.deepseek_v3.model import ModelArgs
from titanlite.models.deepseek_v3.rope import YaRN

# vocab_size comes from the tokenizer at build time.
deepseek_v3_configs: dict[str, ModelArgs] = {
    # Widths are multiples of 16 bytes in bf16 and fp32 (grouped GEMMs run); layer 0 is dense so the
    # debug model covers both kinds of block, and two groups of four experts exercise group-limited routing.
    "debugmodel": ModelArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        ffn_dim=512,
        moe_ffn_dim=128,
        q_lora_rank=0,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        num_experts=8,
        n_shared_experts=1,
        top_k=2,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.0,
        score_func="sigmoid",
        router_bias_update_rate=0.001,
        max_seq_len=2048,
    ),
    "16B": ModelArgs(
        dim=2048,
        n_layers=27,
        n_heads=16,
        ffn_dim=10944,
        moe_ffn_dim=1408,
        q_lora_rank=0,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_experts=64,
        n_shared_experts=2,
        top_k=6,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=False,
        score_func="softmax",
        router_bias_update_rate=0.001,
        vocab_size=102400,
        max_seq_len=163840,
        rope_scaling=YaRN(factor=40, original_max_position_embeddings=4096, mscale=0.707, mscale_all_dim=0.707),
    ),
    "671B": ModelArgs(
        dim=7168,
        n_layers=61,
        n_heads=128,
        ffn_dim=18432,
        moe_ffn_dim=2048,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_experts=256,
        n_shared_experts=1,
        top_k=8,
        first_k_dense_replace=3,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        score_func="sigmoid",
        router_bias_update_rate=0.001,
        vocab_size=129280,
        rope_theta=10000.0,
        max_seq_len=163840,
        rope_scaling=YaRN(
            factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1, mscale_all_dim=1
        ),
    ),
}
