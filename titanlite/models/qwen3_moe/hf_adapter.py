"""Qwen3-MoE <-> Hugging Face `transformers` (`Qwen3MoeForCausalLM`): names and `config.json`.

The model mirrors HF's module tree and RoPE layout (`model.py`), so every tensor converts by name: as Llama's
(`models/llama3/hf_adapter.py`) plus `attention.{q,k}_norm` -> `self_attn.{q,k}_norm` and `moe.gate` ->
`mlp.gate`. The experts, stacked here as transformers 5 holds them (`moe.experts.gate_up_proj` [E, 2I, H],
`down_proj` [E, H, I]), are written one tensor per expert (`mlp.experts.{j}.gate_proj.weight`, `up_proj`,
`down_proj`), the layout of the published checkpoints; import takes that layout or the stacked one
(`save_pretrained(save_original_format=False)`). Details: docs/moe.md#hugging-face-export-and-import.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from titanlite.errors import CheckpointError
from titanlite.models.common.hf_adapter import DECODER_BLOCK, QK_NORM, ByName, expert_pieces, hf_name
from titanlite.models.common.hf_config import decoder_config, differ, hf_rope, norm_act_bias
from titanlite.models.qwen3_moe.model import ModelArgs

_BLOCK = DECODER_BLOCK | QK_NORM | {"moe.gate": "mlp.gate", "moe.experts": "mlp.experts"}


def config_mismatches(config: dict, args: ModelArgs) -> list[tuple[str, Any, Any]]:
    """(HF field, checkpoint value, model value) for every field that changes what the weights compute."""
    theta, scaling = hf_rope(config)
    # transformers 5 writes `num_local_experts` (the published configs: `num_experts`) and no `head_dim`
    # when it is hidden_size / num_attention_heads, the width its attention then takes.
    experts = config.get("num_experts", config.get("num_local_experts"))
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    head_dim = config.get("head_dim") or (hidden // heads if isinstance(hidden, int) and heads else None)
    fields: list[tuple[str, Any, Any]] = [
        ("model_type", config.get("model_type"), "qwen3_moe"),
        ("hidden_size", hidden, args.dim),
        ("num_hidden_layers", config.get("num_hidden_layers"), args.n_layers),
        ("num_attention_heads", heads, args.n_heads),
        ("num_key_value_heads", config.get("num_key_value_heads"), args.kv_heads),
        ("head_dim", head_dim, args.head_dim),
        ("intermediate_size", config.get("intermediate_size"), args.ffn_dim),
        ("moe_intermediate_size", config.get("moe_intermediate_size"), args.moe_ffn_dim),
        ("num_experts", experts, args.num_experts),
        ("num_experts_per_tok", config.get("num_experts_per_tok"), args.top_k),
        ("norm_topk_prob", config.get("norm_topk_prob", False), args.norm_topk_prob),
        ("decoder_sparse_step", config.get("decoder_sparse_step", 1), args.decoder_sparse_step),
        ("mlp_only_layers", sorted(config.get("mlp_only_layers") or []), sorted(args.mlp_only_layers)),
        ("vocab_size", config.get("vocab_size"), args.vocab_size),
        ("rope_theta", theta, float(args.rope_theta)),
        ("rope_scaling", scaling, None),
        *norm_act_bias(config, args),
        ("tie_word_embeddings", bool(config.get("tie_word_embeddings", False)), False),
    ]
    return [(name, theirs, ours) for name, theirs, ours in fields if differ(theirs, ours)]


def hf_config(args: ModelArgs, dtype: torch.dtype, bos_id: int, eos_id: int) -> dict:
    """A `config.json` that `transformers.Qwen3MoeForCausalLM` accepts for this model."""
    widths = {"intermediate_size": args.ffn_dim, "moe_intermediate_size": args.moe_ffn_dim}
    experts = {
        "num_experts": args.num_experts,
        "num_experts_per_tok": args.top_k,
        "norm_topk_prob": args.norm_topk_prob,
        "decoder_sparse_step": args.decoder_sparse_step,
        "mlp_only_layers": list(args.mlp_only_layers),
        "router_aux_loss_coef": args.router_aux_loss_coef,
    }
    flags = {"attention_bias": False, "use_sliding_window": False}
    return decoder_config(
        args, dtype, bos_id, eos_id, ("Qwen3MoeForCausalLM", "qwen3_moe"), widths, False, flags, experts
    )


class Qwen3MoeHFAdapter(ByName):
    """The protocol `titanlite.checkpoint.hf` reads: which tensors, their HF names, and conversions."""

    config_mismatches = staticmethod(config_mismatches)
    config = staticmethod(hf_config)

    @staticmethod
    def params(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of the state dict; a model with aux-loss-free routing biases is refused: Hugging
        Face's Qwen3-MoE routes without one, so its logits would differ."""
        if model.args.router_bias_update_rate > 0:
            raise CheckpointError(
                "a Qwen3-MoE model trained with router_bias_update_rate > 0 routes with a per-expert bias "
                "that Hugging Face's Qwen3MoeForCausalLM does not have: no export or import"
            )
        return list(model.state_dict().items())

    @staticmethod
    def hf_name(fqn: str, args: ModelArgs) -> str:
        return hf_name(fqn, _BLOCK)

    @staticmethod
    def import_name(fqn: str, args: ModelArgs, config: dict) -> str:
        return hf_name(fqn, _BLOCK)

    @staticmethod
    def split_names(fqn: str, args: ModelArgs) -> list[list[str]] | None:
        """Per expert, the HF tensors a stacked expert weight is written as (module docstring)."""
        return expert_pieces(fqn, _BLOCK, args.num_experts)
