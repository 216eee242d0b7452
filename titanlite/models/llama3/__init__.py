"""Llama 3: the model, its flavors, its blocks, its HF adapter; registered as a dense decoder
(`models/common/dense_spec.py`: its tensor-parallel styles, activation memory and step cost)."""

from titanlite.models.common.dense_spec import dense_spec
from titanlite.models.llama3.flavors import llama3_configs
from titanlite.models.llama3.hf_adapter import LlamaHFAdapter
from titanlite.models.llama3.model import SHAPE_KEYS, ModelArgs, Transformer
from titanlite.models.llama3.parallelize import llama_units


def check_args(args: ModelArgs) -> str | None:
    """Attention shapes the model cannot build: heads that do not divide the width or each other, and an
    odd head dim (RoPE rotates pairs of channels)."""
    if args.dim % args.n_heads:
        return f"dim {args.dim} is not a multiple of n_heads {args.n_heads}"
    if args.n_heads % args.kv_heads:
        return f"n_heads {args.n_heads} is not a multiple of n_kv_heads {args.kv_heads}"
    if args.head_dim % 2:
        return f"head dim {args.head_dim} (dim / n_heads) must be even for RoPE"
    return None


SPEC = dense_spec("llama3", Transformer, llama3_configs, llama_units, SHAPE_KEYS, check_args, LlamaHFAdapter())

__all__ = ["SPEC", "ModelArgs", "Transformer", "llama3_configs"]
