"""Qwen3 (dense): the model, its flavors, its blocks, its HF adapter; registered as a dense decoder with
QK-norm (`models/common/dense_spec.py`: its tensor-parallel styles, activation memory and step cost)."""

from titanlite.models.common.dense_spec import dense_spec
from titanlite.models.qwen3.flavors import qwen3_configs
from titanlite.models.qwen3.hf_adapter import Qwen3HFAdapter
from titanlite.models.qwen3.model import SHAPE_KEYS, ModelArgs, Transformer
from titanlite.models.qwen3.parallelize import qwen3_units


def check_args(args: ModelArgs) -> str | None:
    """Attention shapes the model cannot build: query heads that are not a multiple of the key/value
    heads, and an odd head dim (RoPE rotates halves)."""
    if args.n_heads % args.kv_heads:
        return f"n_heads {args.n_heads} is not a multiple of n_kv_heads {args.kv_heads}"
    if args.head_dim % 2:
        return f"head dim {args.head_dim} must be even for RoPE"
    return None


SPEC = dense_spec(
    "qwen3", Transformer, qwen3_configs, qwen3_units, SHAPE_KEYS, check_args, Qwen3HFAdapter(), qk_norm=True
)

__all__ = ["SPEC", "ModelArgs", "Transformer", "qwen3_configs"]
