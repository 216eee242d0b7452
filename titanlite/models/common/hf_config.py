"""What every family's Hugging Face adapter reads and writes of a `config.json` the same way: RoPE's theta
and scaling across transformers 4 and 5, the dtype names, when a checkpoint's value differs from the
model's, the fields of the decoder every family shares (its norm, activation and attention bias) and the
`config.json` of a decoder, around the fields a family adds."""

from __future__ import annotations

import math
from typing import Any

import torch

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_rope(config: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling or None) of an HF config: `rope_theta` + `rope_scaling` (transformers 4) or
    `rope_parameters` (transformers 5); HF's default theta is 10000."""
    params = dict(config.get("rope_parameters") or {})
    theta = config.get("rope_theta", params.pop("rope_theta", 10000.0))
    params.pop("rope_theta", None)
    scaling = config.get("rope_scaling") or params or None
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return float(theta), scaling


def differ(a: Any, b: Any) -> bool:
    """Whether a checkpoint's value and the model's disagree (numbers to a relative 1e-9)."""
    if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
        return not math.isclose(a, b, rel_tol=1e-9)
    return a != b


def norm_act_bias(config: dict, args: Any) -> list[tuple[str, Any, Any]]:
    """(HF field, checkpoint value, model value) of what every family's decoder computes alike: RMSNorm at
    `args.norm_eps`, SiLU, no bias on the attention projections."""
    return [
        ("rms_norm_eps", config.get("rms_norm_eps", 1e-6), args.norm_eps),
        ("hidden_act", config.get("hidden_act", "silu"), "silu"),
        ("attention_bias", config.get("attention_bias", False), False),
    ]


def decoder_config(
    args: Any,
    dtype: torch.dtype,
    bos_id: int,
    eos_id: int,
    family: tuple[str, str],
    widths: dict[str, int],
    tied: bool,
    flags: dict[str, bool],
    experts: dict[str, Any] | None = None,
    rope_scaling: dict | None = None,
) -> dict:
    """A decoder's `config.json`, as `transformers` reads it for `family` (its architecture, its model
    type): the fields every family writes alike, with the family's feed-forward `widths` after
    `hidden_size`, its `experts` after `head_dim`, its RoPE scaling, and its `flags` (biases, sliding
    window) after `tie_word_embeddings`."""
    architecture, model_type = family
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": args.dim,
        **widths,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        **(experts or {}),
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": rope_scaling,
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": tied,
        **flags,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": DTYPE_NAMES[dtype],
    }
