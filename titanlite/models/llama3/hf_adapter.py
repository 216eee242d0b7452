"""Llama 3 <-> Hugging Face `transformers` (`LlamaForCausalLM`): names, RoPE layout and `config.json`.

Names (titanlite -> HF): `tok_embeddings` -> `model.embed_tokens`, `layers.{i}.attention.w{q,k,v,o}` ->
`model.layers.{i}.self_attn.{q,k,v,o}_proj`, `feed_forward.w1/w3/w2` -> `mlp.gate/up/down_proj`,
`attention_norm` -> `input_layernorm`, `ffn_norm` -> `post_attention_layernorm`, `norm` -> `model.norm`,
`output` -> `lm_head` (absent with tied embeddings).

RoPE: titanlite rotates interleaved pairs (x[2i], x[2i+1]) of each head (Meta's convention); HF's
`rotate_half` pairs x[i] with x[i + head_dim/2]. The rows of each head of wq and wk are permuted on
export (and back on import) so that both compute the same attention. The permutation stays within a
head, so an importing rank reads whole heads around its rows (`row_group`).
"""

from __future__ import annotations

import torch
from torch import nn

from titanlite.models.llama3.model import ModelArgs

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

_BLOCK = {
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


def hf_name(fqn: str, tied: bool = False) -> str:
    """The HF name of titanlite parameter `fqn`."""
    if fqn == "tok_embeddings.weight" or (tied and fqn == "output.weight"):
        return "model.embed_tokens.weight"
    if fqn == "output.weight":
        return "lm_head.weight"
    if fqn == "norm.weight":
        return "model.norm.weight"
    _, layer, rest = fqn.split(".", 2)
    module, _, leaf = rest.rpartition(".")
    return f"model.layers.{layer}.{_BLOCK[module]}.{leaf}"


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


def hf_config(args: ModelArgs, dtype: torch.dtype, bos_id: int, eos_id: int) -> dict:
    """A `config.json` that `transformers.LlamaForCausalLM` accepts for this model."""
    rope_scaling = None
    if args.use_scaled_rope:  # the constants of titanlite.models.llama3.model._scale_freqs
        rope_scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
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
        "rope_scaling": rope_scaling,
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
        """(FQN, parameter as stored: shard or plain), in state-dict order, each tied tensor once."""
        tied = model.args.tie_embeddings
        return [(k, v) for k, v in model.state_dict().items() if not (tied and k == "output.weight")]

    @staticmethod
    def hf_name(fqn: str, args: ModelArgs) -> str:
        return hf_name(fqn, args.tie_embeddings)

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
