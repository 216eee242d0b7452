"""Qwen3 (dense) <-> Hugging Face `transformers` (`Qwen3ForCausalLM`): names and `config.json`.

The model mirrors HF's module tree and RoPE layout (`model.py`), so every tensor converts by name only.
Names (titanlite -> HF): `tok_embeddings` -> `model.embed_tokens`, `layers.{i}.attention.w{q,k,v,o}` ->
`model.layers.{i}.self_attn.{q,k,v,o}_proj`, `attention.{q,k}_norm` -> `self_attn.{q,k}_norm`,
`feed_forward.w1/w3/w2` -> `mlp.gate/up/down_proj`, `attention_norm` -> `input_layernorm`, `ffn_norm` ->
`post_attention_layernorm`, `norm` -> `model.norm`, `output` -> `lm_head` (absent when tied: HF ties
`lm_head` to `model.embed_tokens` on load).

Import checks `config.json` against the model args first: every field that changes what the weights
compute (shapes, head dim, vocabulary, RoPE theta and scaling, norm epsilon, activation, biases, sliding
window, tying). A tied checkpoint loads into an untied model by copying the embedding into `output`; an
untied one cannot load into a tied model.
"""

from __future__ import annotations

from typing import Any

import torch

from titanlite.models.common.hf_adapter import DECODER_BLOCK, QK_NORM, ByName, TiedDecoderNames
from titanlite.models.common.hf_config import decoder_config, differ, hf_rope, norm_act_bias
from titanlite.models.qwen3.model import ModelArgs


def config_mismatches(config: dict, args: ModelArgs) -> list[tuple[str, Any, Any]]:
    """(HF field, checkpoint value, model value) for every field of `config` that disagrees with `args`."""
    theta, scaling = hf_rope(config)
    heads = config.get("num_attention_heads")
    fields: list[tuple[str, Any, Any]] = [
        ("model_type", config.get("model_type"), "qwen3"),
        ("hidden_size", config.get("hidden_size"), args.dim),
        ("num_hidden_layers", config.get("num_hidden_layers"), args.n_layers),
        ("num_attention_heads", heads, args.n_heads),
        ("num_key_value_heads", config.get("num_key_value_heads") or heads, args.kv_heads),
        ("head_dim", config.get("head_dim", 128), args.head_dim),
        ("intermediate_size", config.get("intermediate_size"), args.ffn_dim),
        ("vocab_size", config.get("vocab_size"), args.vocab_size),
        ("rope_theta", theta, float(args.rope_theta)),
        ("rope_scaling", scaling, None),
        *norm_act_bias(config, args),
        ("use_sliding_window", config.get("use_sliding_window", False), False),
    ]
    if args.tie_embeddings:
        fields.append(("tie_word_embeddings", bool(config.get("tie_word_embeddings", False)), True))
    return [(name, theirs, ours) for name, theirs, ours in fields if differ(theirs, ours)]


def hf_config(args: ModelArgs, dtype: torch.dtype, bos_id: int, eos_id: int) -> dict:
    """A `config.json` that `transformers.Qwen3ForCausalLM` accepts for this model."""
    widths, flags = {"intermediate_size": args.ffn_dim}, {"attention_bias": False, "use_sliding_window": False}
    family = ("Qwen3ForCausalLM", "qwen3")
    return decoder_config(args, dtype, bos_id, eos_id, family, widths, args.tie_embeddings, flags)


class Qwen3HFAdapter(TiedDecoderNames, ByName):
    """The protocol `titanlite.checkpoint.hf` reads: which tensors, their HF names, and conversions."""

    BLOCK = DECODER_BLOCK | QK_NORM
    config_mismatches = staticmethod(config_mismatches)
    config = staticmethod(hf_config)
