"""Llama 3 <-> Hugging Face `transformers` (`LlamaForCausalLM`): names, RoPE layout and `config.json`.

Names (titanlite -> HF): `tok_embeddings` -> `model.embed_tokens`, `layers.{i}.attention.w{q,k,v,o}` ->
`model.layers.{i}.self_attn.{q,k,v,o}_proj`, `feed_forward.w1/w3/w2` -> `mlp.gate/up/down_proj`,
`attention_norm` -> `input_layernorm`, `ffn_norm` -> `post_attention_layernorm`, `norm` -> `model.norm`,
`output` -> `lm_head` (absent with tied embeddings).

Import checks the checkpoint's `config.json` against the model args first (`config_mismatches`): every
field that changes what the weights compute (shapes, vocabulary, RoPE theta and scaling, norm epsilon,
activation, biases, tying). A tied checkpoint (`tie_word_embeddings`, as Llama 3.2 ships) loads into an
untied model by copying `model.embed_tokens` into `output` as well; an untied one cannot load into a
tied model.

RoPE: titanlite rotates interleaved pairs (x[2i], x[2i+1]) of each head (Meta's convention); HF's
`rotate_half` pairs x[i] with x[i + head_dim/2]. The rows of each head of wq and wk are permuted on
export (and back on import) so that both compute the same attention. The permutation stays within a
head, so an importing rank reads whole heads around its rows (`row_group`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from titanlite.models.common.hf_adapter import DECODER_BLOCK, hf_name, params_once, reads_tied
from titanlite.models.common.hf_config import DTYPE_NAMES, differ, hf_rope
from titanlite.models.llama3.model import ModelArgs


def rope_heads(fqn: str, args: ModelArgs) -> int:
    """Number of heads whose rows are RoPE-permuted in parameter `fqn` (0: not permuted)."""
    if fqn.endswith("attention.wq.weight"):
        return args.n_heads
    if fqn.endswith("attention.wk.weight"):
        return args.kv_heads
    return 0


def to_hf_rope(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of whole heads, interleaved pairs -> halves (HF's rotate_half layout)."""
    return w.view(-1, head_dim // 2, 2, w.shape[-1]).transpose(1, 2).reshape(w.shape)


def from_hf_rope(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Inverse of `to_hf_rope`."""
    return w.view(-1, 2, head_dim // 2, w.shape[-1]).transpose(1, 2).reshape(w.shape)


def rope_scaling(args: ModelArgs) -> dict | None:
    """HF's `rope_scaling` for these args (None: unscaled)."""
    if not args.use_scaled_rope:
        return None
    return {
        "rope_type": "llama3",
        "factor": float(args.rope_scaling_factor),
        "low_freq_factor": float(args.rope_low_freq_factor),
        "high_freq_factor": float(args.rope_high_freq_factor),
        "original_max_position_embeddings": args.rope_original_max_seq_len,
    }


def config_mismatches(config: dict, args: ModelArgs) -> list[tuple[str, Any, Any]]:
    """(HF field, checkpoint value, model value) for every field of `config` that disagrees with `args`.

    A tied checkpoint is no mismatch for an untied model (the embedding is copied into the output)."""
    heads = config.get("num_attention_heads")
    theta, scaling = hf_rope(config)
    ours_scaling = rope_scaling(args)
    fields: list[tuple[str, Any, Any]] = [
        ("model_type", config.get("model_type", "llama"), "llama"),
        ("hidden_size", config.get("hidden_size"), args.dim),
        ("num_hidden_layers", config.get("num_hidden_layers"), args.n_layers),
        ("num_attention_heads", heads, args.n_heads),
        ("num_key_value_heads", config.get("num_key_value_heads") or heads, args.kv_heads),
        ("intermediate_size", config.get("intermediate_size"), args.ffn_hidden_dim),
        ("vocab_size", config.get("vocab_size"), args.vocab_size),
        ("rope_theta", theta, float(args.rope_theta)),
        ("rms_norm_eps", config.get("rms_norm_eps", 1e-6), args.norm_eps),
        ("hidden_act", config.get("hidden_act", "silu"), "silu"),
        ("attention_bias", config.get("attention_bias", False), False),
        ("mlp_bias", config.get("mlp_bias", False), False),
    ]
    if config.get("head_dim") is not None and heads:
        fields.append(("head_dim", config["head_dim"], args.head_dim))
    if scaling is None or ours_scaling is None:
        fields.append(("rope_scaling", scaling, ours_scaling))
    else:
        kind = scaling.get("rope_type", scaling.get("type"))
        fields.append(("rope_scaling.rope_type", kind, "llama3"))
        if kind == "llama3":
            fields += [(f"rope_scaling.{k}", scaling.get(k), v) for k, v in ours_scaling.items() if k != "rope_type"]
    if args.tie_embeddings:
        fields.append(("tie_word_embeddings", bool(config.get("tie_word_embeddings", False)), True))
    return [(name, theirs, ours) for name, theirs, ours in fields if differ(theirs, ours)]


def hf_config(args: ModelArgs, dtype: torch.dtype, bos_id: int, eos_id: int) -> dict:
    """A `config.json` that `transformers.LlamaForCausalLM` accepts for this model."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": rope_scaling(args),
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": args.tie_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": DTYPE_NAMES[dtype],
    }


class LlamaHFAdapter:
    """The protocol `titanlite.checkpoint.hf` reads: which tensors, their HF names, and conversions."""

    @staticmethod
    def params(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
        return params_once(model)

    @staticmethod
    def hf_name(fqn: str, args: ModelArgs) -> str:
        return hf_name(fqn, DECODER_BLOCK, args.tie_embeddings)

    @staticmethod
    def import_name(fqn: str, args: ModelArgs, config: dict) -> str:
        """The HF tensor that parameter `fqn` is read from: with a tied checkpoint, `output` reads the
        embedding."""
        return hf_name(fqn, DECODER_BLOCK, reads_tied(args.tie_embeddings, config))

    @staticmethod
    def config_mismatches(config: dict, args: ModelArgs) -> list[tuple[str, Any, Any]]:
        return config_mismatches(config, args)

    @staticmethod
    def to_hf(fqn: str, full: torch.Tensor, args: ModelArgs) -> torch.Tensor:
        return to_hf_rope(full, args.head_dim) if rope_heads(fqn, args) else full

    @staticmethod
    def row_group(fqn: str, args: ModelArgs) -> int:
        """HF rows are permuted within groups of this many rows (1: not permuted)."""
        return args.head_dim if rope_heads(fqn, args) else 1

    @staticmethod
    def from_hf(fqn: str, rows: torch.Tensor, args: ModelArgs) -> torch.Tensor:
        """`rows` (whole groups of `row_group` rows, read from HF) in titanlite's layout."""
        return from_hf_rope(rows, args.head_dim) if rope_heads(fqn, args) else rows

    @staticmethod
    def config(args: ModelArgs, dtype: torch.dtype, bos_id: int, eos_id: int) -> dict:
        return hf_config(args, dtype, bos_id, eos_id)
