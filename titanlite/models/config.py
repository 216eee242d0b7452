"""The `model` section of the config: the family, its flavor, overrides of the flavor's shape and the tokenizer,
beside the registry that resolves them (`registry.py`). Torch-free, importing only `titanlite.config.ranges`:
the config's schema (titanlite/config/schema.py) composes it into `JobConfig`, which the launcher and `--help`
read before any torch process exists."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from titanlite.config.ranges import NON_NEGATIVE

SHAPE = {**NON_NEGATIVE, "shape": True}
"""Metadata of a `model.*` key overriding the flavor's shape (`shape_fields`)."""


@dataclass
class Model:
    """Which model: a family, a named flavor, optional overrides of the flavor's shape, the tokenizer."""

    name: str = "llama3"
    """Model family: llama3, qwen3, qwen3_moe, deepseek_v3, or one registered with
    titanlite.models.registry.register_model."""
    flavor: str = "debugmodel"
    """The family's named shape (llama3: debugmodel, 1B, 8B, 70B, 405B; qwen3: debugmodel, debugmodel_tied,
    0.6B, 1.7B, 4B, 8B, 14B, 32B; qwen3_moe: debugmodel, 30B-A3B, 235B-A22B; deepseek_v3: debugmodel, 16B,
    671B); the keys below override parts of it."""
    tokenizer_path: str = ""
    """A tiktoken-format BPE file (e.g. Llama 3's original/tokenizer.model), or a Hugging Face tokenizer.json
    (the file, or its folder: Qwen3's, Llama 3's; needs the hf extra); empty = the bundled 2k vocabulary."""
    vocab_size: int = field(default=0, metadata=NON_NEGATIVE)
    """Rows of the embedding and the output projection; 0 = the tokenizer's ids. A larger size pads them with
    rows no token uses, as published checkpoints do (Qwen3: 151,936 rows for its tokenizer's 151,669 ids),
    so that their weights load; smaller than the tokenizer is refused."""
    # Shape overrides of the flavor (0 = the flavor's value); checked before any rank starts against the
    # family's `shape.keys` (titanlite/models/registry.py).
    n_layers: int = field(default=0, metadata=SHAPE)
    """Transformer blocks; 0 = the flavor's."""
    dim: int = field(default=0, metadata=SHAPE)
    """Model (embedding) width; 0 = the flavor's. Must be a multiple of n_heads."""
    n_heads: int = field(default=0, metadata=SHAPE)
    """Attention (query) heads; 0 = the flavor's. Must divide dim."""
    n_kv_heads: int = field(default=0, metadata=SHAPE)
    """Key/value heads (grouped-query attention); 0 = the flavor's. Must divide n_heads."""
    ffn_dim: int = field(default=0, metadata=SHAPE)
    """Hidden width of the feed-forward (SwiGLU) layer, exactly; 0 = from the flavor and ffn_dim_multiplier."""
    ffn_dim_multiplier: float = field(default=0.0, metadata=SHAPE)
    """Scales the default feed-forward width 8/3 x dim (then rounded up to the flavor's multiple_of); 0 = the
    flavor's."""
    rope_theta: float = field(default=0.0, metadata=SHAPE)
    """RoPE base frequency; 0 = the flavor's."""
    max_seq_len: int = field(default=0, metadata=SHAPE)
    """The longest sequence the model supports (training.seq_len must fit); 0 = the flavor's."""
    num_experts: int = field(default=0, metadata=SHAPE)
    """Mixture of experts (qwen3_moe): experts per MoE layer; 0 = the flavor's."""
    top_k: int = field(default=0, metadata=SHAPE)
    """Mixture of experts: experts each token is routed to; 0 = the flavor's."""
    moe_ffn_dim: int = field(default=0, metadata=SHAPE)
    """Mixture of experts: hidden width of each expert's SwiGLU; 0 = the flavor's."""
    router_aux_loss_coef: float = field(default=0.0, metadata=SHAPE)
    """Mixture of experts: weight of the load-balancing loss in the training loss; 0 = the flavor's."""
    router_bias_update_rate: float = field(default=0.0, metadata=SHAPE)
    """Mixture of experts: aux-loss-free balancing, the step of each expert's routing bias after every
    optimizer step (DeepSeek-V3: 0.001); 0 = the flavor's (0.001 in deepseek_v3's flavors, off in the
    others)."""
    moe_experts: Literal["grouped_mm", "loop"] = "grouped_mm"
    """Mixture of experts: how the experts compute, as grouped GEMMs (`torch._grouped_mm`, where the widths
    and dtype fit; the loop elsewhere) or always as a loop over the experts (the reference, a benchmark
    baseline). The same weights either way: not part of the model's shape."""
    attn_mask_type: Literal["causal", "block_causal"] = "causal"
    """Attention over packed documents: `causal` (a token attends every earlier token of its sequence) or
    `block_causal` (only the earlier tokens of its own document; RoPE positions restart at each document).
    block_causal uses flex attention on CUDA and a dense mask on CPU; see docs/long_context.md."""
