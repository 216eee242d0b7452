"""What every family's Hugging Face adapter shares: HF's decoder names for the modules the families have in
common, the rule that names the embedding and output projection (tied or not), the tensors an export
writes and their names for a family that may tie them, and the conversion of a tensor that HF stores as
titanlite does (by name only).

The per-expert names of the stacked experts are shared by the mixture-of-experts families; their other
parts (their extra modules, `config.json`, RoPE permutation) stay in their `hf_adapter.py`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

DECODER_BLOCK = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
"""A decoder block's modules (titanlite -> HF, under `model.layers.{i}.`): TorchTitan's names to HF's Llama
and Qwen3 names."""

QK_NORM = {"attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm"}
"""The QK-norm attention's norms (`grouped_query_attention.py`), as both Qwen3 families name them in HF."""


def hf_name(fqn: str, block: dict[str, str], tied: bool = False) -> str:
    """The HF name of titanlite parameter `fqn`, a block's module named through `block` (`output` is the
    embedding when `tied`)."""
    if fqn == "tok_embeddings.weight" or (tied and fqn == "output.weight"):
        return "model.embed_tokens.weight"
    if fqn == "output.weight":
        return "lm_head.weight"
    if fqn == "norm.weight":
        return "model.norm.weight"
    _, layer, rest = fqn.split(".", 2)
    module, _, leaf = rest.rpartition(".")
    return f"model.layers.{layer}.{block[module]}.{leaf}"


def expert_pieces(fqn: str, block: dict[str, str], num_experts: int) -> list[list[str]] | None:
    """Per expert, the HF tensors that a stacked expert weight (`moe.experts.gate_up_proj` [E, 2I, H] or
    `down_proj` [E, H, I], named through `block`) is written as: `mlp.experts.{j}.gate_proj.weight` and
    `up_proj.weight`, or `down_proj.weight`, the published checkpoints' layout; None for another tensor."""
    prefix, _, leaf = fqn.rpartition(".")
    if not prefix.endswith("moe.experts"):
        return None
    base = hf_name(f"{prefix}.weight", block).removesuffix(".weight")
    pieces = ["gate_proj", "up_proj"] if leaf == "gate_up_proj" else ["down_proj"]
    return [[f"{base}.{j}.{piece}.weight" for piece in pieces] for j in range(num_experts)]


def reads_tied(tie_embeddings: bool, config: dict) -> bool:
    """Whether import reads `output` from the embedding: the model is tied, or the checkpoint is (a tied
    checkpoint loads into an untied model by copying the embedding)."""
    return tie_embeddings or bool(config.get("tie_word_embeddings", False))


def params_once(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(FQN, parameter as stored: shard or plain), in state-dict order, a tied output projection once
    (as the embedding)."""
    tied = model.args.tie_embeddings
    return [(k, v) for k, v in model.state_dict().items() if not (tied and k == "output.weight")]


class TiedDecoderNames:
    """The tensors and HF names of a family whose output projection may be tied to the embedding: `BLOCK`
    names its decoder block's modules (titanlite -> HF); import reads `output` from the embedding of a
    tied checkpoint."""

    BLOCK: dict[str, str] = DECODER_BLOCK

    @staticmethod
    def params(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
        return params_once(model)

    def hf_name(self, fqn: str, args: Any) -> str:
        return hf_name(fqn, self.BLOCK, args.tie_embeddings)

    def import_name(self, fqn: str, args: Any, config: dict) -> str:
        """The HF tensor that parameter `fqn` is read from: with a tied checkpoint, `output` reads the
        embedding."""
        return hf_name(fqn, self.BLOCK, reads_tied(args.tie_embeddings, config))


class ByName:
    """The conversions of a family whose every tensor HF stores as titanlite does: none."""

    @staticmethod
    def to_hf(fqn: str, full: torch.Tensor, args: object) -> torch.Tensor:
        return full

    @staticmethod
    def row_group(fqn: str, args: object) -> int:
        return 1

    @staticmethod
    def from_hf(fqn: str, rows: torch.Tensor, args: object) -> torch.Tensor:
        return rows
