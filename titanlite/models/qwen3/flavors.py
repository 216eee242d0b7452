"""Qwen3 (dense) flavors: a CPU-sized debug model and the published shapes.

0.6B ... 32B are the `config.json` values Qwen published with the Qwen3 checkpoints on the Hugging Face
hub (the fields of `transformers.Qwen3Config`): head dim 128, 8 key/value heads, RoPE theta 1e6, RMSNorm
eps 1e-6, 40,960 positions, vocabulary 151,936 (replaced by the tokenizer's size at build time), and
`tie_word_embeddings` true for 0.6B, 1.7B and 4B only.

    flavor  hidden_size  layers  heads  kv heads  intermediate_size  tied
    0.6B    1024         28      16     8         3072               yes
    1.7B    2048         28      16     8         6144               yes
    4B      2560         36      32     8         9728               yes
    8B      4096         36      32     8         12288              no
    14B     5120         40      40     8         17408              no
    32B     5120         64      64     8         25600              no
"""

from titanlite.models.qwen3.model import ModelArgs


def _published(dim: int, n_layers: int, n_heads: int, ffn_dim: int, tied: bool) -> ModelArgs:
    return ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8, ffn_dim=ffn_dim, tie_embeddings=tied)


qwen3_configs: dict[str, ModelArgs] = {
    # Sized like Llama 3's debug model (dim 256, 6 blocks, its FFN width) on the bundled vocabulary, untied
    # like Llama's: on 5M parameters and a 2k vocabulary the tied twin learns slower (loss 5.91 against 5.06
    # after the debug config's 100 steps); it is the flavor that exercises tying.
    "debugmodel": ModelArgs(
        dim=256, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=32, ffn_dim=768, max_seq_len=2048, tie_embeddings=False
    ),
    "debugmodel_tied": ModelArgs(
        dim=256, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=32, ffn_dim=768, max_seq_len=2048, tie_embeddings=True
    ),
    "0.6B": _published(1024, 28, 16, 3072, tied=True),
    "1.7B": _published(2048, 28, 16, 6144, tied=True),
    "4B": _published(2560, 36, 32, 9728, tied=True),
    "8B": _published(4096, 36, 32, 12288, tied=False),
    "14B": _published(5120, 40, 40, 17408, tied=False),
    "32B": _published(5120, 64, 64, 25600, tied=False),
}
