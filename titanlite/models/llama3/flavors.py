"""Llama 3 flavors: the published shapes."""

from titanlite.models.llama3.model import ModelArgs


def _published(dim: int, n_layers: int, n_heads: int, ffn_dim_multiplier: float, multiple_of: int, **rope) -> ModelArgs:
    """A published Llama 3 shape: 8 key/value heads, RoPE theta 500,000 scaled for 131,072 positions."""
    return ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        ffn_dim_multiplier=ffn_dim_multiplier,
        multiple_of=multiple_of,
        rope_theta=500000,
        max_seq_len=131072,
        use_scaled_rope=True,
        **rope,
    )


# vocab_size of debugmodel comes from the tokenizer at build time.
llama3_configs: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(dim=256, n_layers=6, n_heads=16, n_kv_heads=8, rope_theta=500000, max_seq_len=2048),
    # Llama 3.2 1B: its shapes and its factor-32 RoPE scaling, so its Hugging Face checkpoint loads. Llama 3.2
    # ties the output to the embedding; this flavor keeps them untied (the tied HF weight is copied into
    # both on import), since the parallelize plans wrap each module's parameter on its own and would
    # silently untie a shared one.
    "1B": _published(2048, 16, 32, 1.5, 256, rope_scaling_factor=32.0),
    "8B": _published(4096, 32, 32, 1.3, 1024),
    "70B": _published(8192, 80, 64, 1.3, 4096),
    "405B": _published(16384, 126, 128, 1.2, 4096),
}
