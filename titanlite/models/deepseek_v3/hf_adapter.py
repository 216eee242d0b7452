"""DeepSeek-V3 <-> Hugging Face `transformers` (`DeepseekV3ForCausalLM`): names and `config.json`.

Every tensor converts by name. The latent attention's projections take HF's names (`wq` or `wq_a`,
`q_norm`, `wq_b` -> `q_proj` or `q_a_proj`, `q_a_layernorm`, `q_b_proj`; `wkv_a`, `kv_norm`, `wkv_b` ->
`kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`); their RoPE rows stay in the interleaved-pairs layout
of the published weights, which titanlite rotates as they are and HF rotates with `rope_interleave`
(written true, and required on import). The router is `mlp.gate`, its balancing bias (`moe.expert_bias`)
HF's `mlp.gate.e_score_correction_bias`, the shared experts `mlp.shared_experts.{gate,up,down}_proj`. The
stacked experts are written one tensor per expert, as the published checkpoints hold them; import takes
that layout or the stacked one. HF's router is sigmoid only: a softmax-routed model is refused. The
published FP8 weights (`quantization_config`) are refused on import. Details: docs/deepseek_v3.md.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from titanlite.errors import CheckpointError
from titanlite.models.common.hf_adapter import DECODER_BLOCK, ByName, expert_pieces, hf_name
from titanlite.models.common.hf_config import decoder_config, differ, hf_rope, norm_act_bias
from titanlite.models.deepseek_v3.model import ModelArgs

_BLOCK = DECODER_BLOCK | {
    "attention.wq_a": "self_attn.q_a_proj",
    "attention.q_norm": "self_attn.q_a_layernorm",
    "attention.wq_b": "self_attn.q_b_proj",
    "attention.wkv_a": "self_attn.kv_a_proj_with_mqa",
    "attention.kv_norm": "self_attn.kv_a_layernorm",
    "attention.wkv_b": "self_attn.kv_b_proj",
    "moe.gate": "mlp.gate",
    "moe.experts": "mlp.experts",
    "moe.shared_experts.w1": "mlp.shared_experts.gate_proj",
    "moe.shared_experts.w3": "mlp.shared_experts.up_proj",
    "moe.shared_experts.w2": "mlp.shared_experts.down_proj",
}

_YARN_FIELDS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
_YARN_DEFAULTS = {"beta_fast": 32, "beta_slow": 1}
"""The values HF's YaRN takes for a field its `config.json` leaves out (`_compute_yarn_parameters`)."""


def _scaling_mismatches(scaling: dict | None, args: ModelArgs) -> list[tuple[str, Any, Any]]:
    """(field, checkpoint value, model value) of the RoPE scaling: none, or YaRN's fields as they change
    what HF computes (`rope.py`): `mscale` counts only with a `mscale_all_dim`, and a missing one is 0."""
    ours = args.rope_scaling
    if scaling is None or ours is None:
        return [("rope_scaling", scaling, ours and "yarn")]
    theirs = {k: scaling.get(k, _YARN_DEFAULTS.get(k)) for k in _YARN_FIELDS[:4]}
    theirs["mscale_all_dim"] = scaling.get("mscale_all_dim") or 0.0
    fields = [("rope_scaling.rope_type", scaling.get("rope_type", scaling.get("type")), "yarn")]
    fields += [(f"rope_scaling.{k}", v, getattr(ours, k)) for k, v in theirs.items()]
    if ours.mscale_all_dim:
        fields.append(("rope_scaling.mscale", scaling.get("mscale") or 0.0, ours.mscale))
    # What HF's YaRN reads that titanlite's does not: an explicit attention factor, no truncation.
    fields.append(("rope_scaling.attention_factor", scaling.get("attention_factor"), None))
    fields.append(("rope_scaling.truncate", scaling.get("truncate", True), True))
    return fields


def _first_dense(args: ModelArgs) -> int:
    """HF's `first_k_dense_replace` of the model: every layer without routed experts (HF makes the layers
    from that index MoE layers whatever the expert count)."""
    return args.first_k_dense_replace if args.num_experts else args.n_layers


def config_mismatches(config: dict, args: ModelArgs) -> list[tuple[str, Any, Any]]:
    """(HF field, checkpoint value, model value) for every field that changes what the weights compute."""
    theta, scaling = hf_rope(config)
    q_lora = config.get("q_lora_rank", "absent")
    heads = config.get("num_attention_heads")
    fields: list[tuple[str, Any, Any]] = [
        ("model_type", config.get("model_type"), "deepseek_v3"),
        ("hidden_size", config.get("hidden_size"), args.dim),
        ("num_hidden_layers", config.get("num_hidden_layers"), args.n_layers),
        ("num_attention_heads", heads, args.n_heads),
        ("num_key_value_heads", config.get("num_key_value_heads") or heads, args.n_heads),
        ("q_lora_rank", 0 if q_lora is None else q_lora, args.q_lora_rank),
        ("kv_lora_rank", config.get("kv_lora_rank"), args.kv_lora_rank),
        ("qk_nope_head_dim", config.get("qk_nope_head_dim"), args.qk_nope_head_dim),
        ("qk_rope_head_dim", config.get("qk_rope_head_dim"), args.qk_rope_head_dim),
        ("v_head_dim", config.get("v_head_dim"), args.v_head_dim),
        # transformers sets head_dim to the RoPE width, the width its rotary tables take.
        ("head_dim", config.get("head_dim", args.qk_rope_head_dim), args.qk_rope_head_dim),
        ("intermediate_size", config.get("intermediate_size"), args.ffn_dim),
        ("moe_intermediate_size", config.get("moe_intermediate_size"), args.moe_ffn_dim),
        ("n_routed_experts", config.get("n_routed_experts", config.get("num_local_experts")), args.num_experts),
        ("n_shared_experts", config.get("n_shared_experts"), args.n_shared_experts),
        ("num_experts_per_tok", config.get("num_experts_per_tok"), args.top_k),
        ("first_k_dense_replace", config.get("first_k_dense_replace"), _first_dense(args)),
        ("n_group", config.get("n_group"), args.n_group),
        ("topk_group", config.get("topk_group"), args.topk_group),
        ("routed_scaling_factor", config.get("routed_scaling_factor"), args.routed_scaling_factor),
        ("norm_topk_prob", config.get("norm_topk_prob"), args.norm_topk_prob),
        ("scoring_func", config.get("scoring_func", "sigmoid"), args.score_func),
        ("vocab_size", config.get("vocab_size"), args.vocab_size),
        ("rope_theta", theta, float(args.rope_theta)),
        *_scaling_mismatches(scaling, args),
        ("rope_interleave", config.get("rope_interleave", True), True),
        *norm_act_bias(config, args),
        ("tie_word_embeddings", bool(config.get("tie_word_embeddings", False)), False),
        ("quantization_config", config.get("quantization_config"), None),
    ]
    return [(name, theirs, ours) for name, theirs, ours in fields if differ(theirs, ours)]


def hf_config(args: ModelArgs, dtype: torch.dtype, bos_id: int, eos_id: int) -> dict:
    """A `config.json` that `transformers.DeepseekV3ForCausalLM` accepts for this model. It has no
    `head_dim`: transformers derives it (the RoPE width), and a written one would replace it."""
    widths = {"intermediate_size": args.ffn_dim, "moe_intermediate_size": args.moe_ffn_dim}
    experts = {
        "q_lora_rank": args.q_lora_rank or None,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "n_routed_experts": args.num_experts,
        "n_shared_experts": args.n_shared_experts,
        "num_experts_per_tok": args.top_k,
        "first_k_dense_replace": _first_dense(args),
        "n_group": args.n_group,
        "topk_group": args.topk_group,
        "routed_scaling_factor": args.routed_scaling_factor,
        "norm_topk_prob": args.norm_topk_prob,
        "scoring_func": args.score_func,
        "topk_method": "noaux_tc",
        "num_nextn_predict_layers": 0,
    }
    yarn = args.rope_scaling
    scaling = None if yarn is None else {"rope_type": "yarn", **{k: getattr(yarn, k) for k in _YARN_FIELDS}}
    flags = {"attention_bias": False, "rope_interleave": True}
    family = ("DeepseekV3ForCausalLM", "deepseek_v3")
    config = decoder_config(args, dtype, bos_id, eos_id, family, widths, False, flags, experts, scaling)
    del config["head_dim"]
    return config


class DeepseekV3HFAdapter(ByName):
    """The protocol `titanlite.checkpoint.hf` reads: which tensors, their HF names, and conversions."""

    config_mismatches = staticmethod(config_mismatches)
    config = staticmethod(hf_config)
    keep_fp32 = ("moe.gate.", "moe.expert_bias")
    """The router's weight and balancing bias, written in fp32 whatever `checkpoint.export_dtype`:
    transformers holds them in fp32 (`_keep_in_fp32_modules_strict`), and a bf16 bias would round the small
    differences that pick the experts."""

    @staticmethod
    def params(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of the state dict; a softmax-routed model is refused: Hugging Face's
        DeepseekV3ForCausalLM routes with sigmoid scores only, so its logits would differ."""
        if model.args.score_func != "sigmoid":
            raise CheckpointError(
                f"a DeepSeek-V3 model with model.score_func {model.args.score_func!r} routes differently from "
                "Hugging Face's DeepseekV3ForCausalLM, whose router scores with a sigmoid only: no export or import"
            )
        return list(model.state_dict().items())

    @staticmethod
    def hf_name(fqn: str, args: ModelArgs) -> str:
        if fqn.endswith("moe.expert_bias"):
            return hf_name(fqn.replace("moe.expert_bias", "moe.gate.e_score_correction_bias"), _BLOCK)
        return hf_name(fqn, _BLOCK)

    @classmethod
    def import_name(cls, fqn: str, args: ModelArgs, config: dict) -> str:
        return cls.hf_name(fqn, args)

    @staticmethod
    def split_names(fqn: str, args: ModelArgs) -> list[list[str]] | None:
        """Per expert, the HF tensors a stacked expert weight is written as (module docstring)."""
        return expert_pieces(fqn, _BLOCK, args.num_experts)
