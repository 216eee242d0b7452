"""Llama 3 flavors: the published shapes."""

from titanlite.models.llama3.model import ModelArgs

# vocab_size of debugmodel comes from the tokenizer at build time.
llama3_configs: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(dim=256, n_layers=6, n_heads=16, n_kv_heads=8, rope_theta=500000, max_seq_len=2048),
    # Llama 3.2 1B: its shapes and its factor-32 RoPE scaling, so its Hugging Face checkpoint loads. Llama 3.2
    # ties the output to the embedding; this flavor keeps them untied (the tied HF weight is copied into
    # both on import), since the parallelize plans wrap each module's parameter on its own and would
    # silently untie a shared one.
    "1B": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        rope_theta=500000,
        max_seq_len=131072,
        use_scaled_rope=True,
        rope_scaling_factor=32.0,
    ),
    "8B": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        rope_theta=500000,
        max_seq_len=131072,
        use_scaled_rope=True,
    ),
    "70B": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        rope_theta=500000,
        max_seq_len=131072,
        use_scaled_rope=True,
    ),
    "405B": ModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
        rope_theta=500000,
        max_seq_len=131072,
        use_scaled_rope=True,
    ),
}
