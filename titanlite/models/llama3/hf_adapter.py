"""Llama 3 <-> Hugging Face `transformers` (`LlamaForCausalLM`): names, RoPE layout and `config.json`.

Names (titanlite -> HF): `tok_embeddings` -> `model.embed_tokens`, `layers.{i}.attention.w{q,k,v,o}` ->
`model.layers.{i}.self_attn.{q,k,v,o}_proj`, `feed_forward.w1/w3/w2` -> `mlp.gate/up/down_proj`,
`attention_norm` -> `input_layernorm`, `ffn_norm` -> `post_attention_layernorm`, `norm` -> `model.norm`,
`output` -> `lm_head` (absent with tied embeddings). Import checks `config.json` first (`config_mismatches`);
a tied checkpoint loads into an untied model by copying the embedding into `output`. RoPE: titanlite rotates
interleaved pairs, HF `rotate_half` halves, so the rows of each head of wq and wk are permuted on export and
back on import, within a head (an importing rank reads whole heads, `row_group`).
"""

from __future__ import annotations

from typing import Any

import torch

from titanlite.models.common.hf_adapter import TiedDecoderNames
from titanlite.models.common.hf_config import decoder_config, differ, hf_rope, norm_act_bias
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
        *norm_act_bias(config, args),
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
    widths, flags = {"intermediate_size": args.ffn_hidden_dim}, {"attention_bias": False, "mlp_bias": False}
    family = ("LlamaForCausalLM", "llama")
    return decoder_config(
        args, dtype, bos_id, eos_id, family, widths, args.tie_embeddings, flags, rope_scaling=rope_scaling(args)
    )


class LlamaHFAdapter(TiedDecoderNames):
    """The protocol `titanlite.checkpoint.hf` reads: which tensors, their HF names, and conversions."""

    config_mismatches = staticmethod(config_mismatches)
    config = staticmethod(hf_config)

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
