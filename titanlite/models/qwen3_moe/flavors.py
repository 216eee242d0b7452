"""Qwen3-MoE flavors: a CPU-sized debug model and the published shapes.

30B-A3B and 235B-A22B are the `config.json` values Qwen published with the checkpoints (the same as
Hugging Face's `Qwen3MoeConfig` fields): 128 experts, 8 per token, `norm_topk_prob` true, head dim 128,
4 key/value heads, RoPE theta 1e6, RMSNorm eps 1e-6, 40,960 positions, every layer a MoE layer.
"""

from titanlite.models.qwen3_moe.model import ModelArgs


def _published(dim: int, n_layers: int, n_heads: int, ffn_dim: int, moe_ffn_dim: int) -> ModelArgs:
    """A published Qwen3-MoE shape (module docstring)."""
    return ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=4,
        head_dim=128,
        ffn_dim=ffn_dim,
        moe_ffn_dim=moe_ffn_dim,
        num_experts=128,
        top_k=8,
        router_aux_loss_coef=0.001,
        max_seq_len=40960,
    )


# vocab_size comes from the tokenizer at build time.
qwen3_moe_configs: dict[str, ModelArgs] = {
    # Widths are multiples of 16 bytes in bf16 and fp32, so the experts run as grouped GEMMs. Layer 0 is
    # dense (mlp_only_layers) so the debug model covers both kinds of block.
    "debugmodel": ModelArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        ffn_dim=512,
        moe_ffn_dim=128,
        num_experts=8,
        top_k=2,
        mlp_only_layers=(0,),
        router_aux_loss_coef=0.01,
        max_seq_len=2048,
    ),
    "30B-A3B": _published(2048, 48, 32, 6144, 768),
    "235B-A22B": _published(4096, 94, 64, 12288, 1536),
}
