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
from torch import nn

from titanlite.models.common.hf_adapter import DECODER_BLOCK, QK_NORM, ByName, hf_name, params_once, reads_tied
from titanlite.models.common.hf_config import DTYPE_NAMES, differ, hf_rope
from titanlite.models.qwen3.model import ModelArgs

_BLOCK = DECODER_BLOCK | QK_NORM


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
        ("rms_norm_eps", config.get("rms_norm_eps", 1e-6), args.norm_eps),
        ("hidden_act", config.get("hidden_act", "silu"), "silu"),
        ("attention_bias", config.get("attention_bias", False), False),
        ("use_sliding_window", config.get("use_sliding_window", False), False),
    ]
    if args.tie_embeddings:
        fields.append(("tie_word_embeddings", bool(config.get("tie_word_embeddings", False)), True))
    return [(name, theirs, ours) for name, theirs, ours in fields if differ(theirs, ours)]


def hf_config(args: ModelArgs, dtype: torch.dtype, bos_id: int, eos_id: int) -> dict:
    """A `config.json` that `transformers.Qwen3ForCausalLM` accepts for this model."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "use_sliding_window": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": DTYPE_NAMES[dtype],
    }


class Qwen3HFAdapter(ByName):
    """The protocol `titanlite.checkpoint.hf` reads: which tensors, their HF names, and conversions."""

    @staticmethod
    def params(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
        return params_once(model)

    @staticmethod
    def hf_name(fqn: str, args: ModelArgs) -> str:
        return hf_name(fqn, _BLOCK, args.tie_embeddings)

    @staticmethod
    def import_name(fqn: str, args: ModelArgs, config: dict) -> str:
        """The HF tensor that parameter `fqn` is read from: with a tied checkpoint, `output` reads the
        embedding."""
        return hf_name(fqn, _BLOCK, reads_tied(args.tie_embeddings, config))

    @staticmethod
    def config_mismatches(config: dict, args: ModelArgs) -> list[tuple[str, Any, Any]]:
        return config_mismatches(config, args)

    @staticmethod
    def config(args: ModelArgs, dtype: torch.dtype, bos_id: int, eos_id: int) -> dict:
        return hf_config(args, dtype, bos_id, eos_id)
