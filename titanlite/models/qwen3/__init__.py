"""Qwen3 (dense): the model, its flavors, its blocks and tensor-parallel plan, its HF adapter; its activation
memory and step cost are the dense decoder's with QK-norm (`models/common/dense_*.py`)."""

from functools import partial

from titanlite.models.common.dense_activations import activation_bytes
from titanlite.models.common.dense_cost import step_cost
from titanlite.models.common.tensor_parallel import dense_tp_divisible
from titanlite.models.qwen3.flavors import qwen3_configs
from titanlite.models.qwen3.hf_adapter import Qwen3HFAdapter
from titanlite.models.qwen3.model import SHAPE_KEYS, ModelArgs, Transformer
from titanlite.models.qwen3.parallelize import qwen3_tp_plan, qwen3_units
from titanlite.models.registry import ModelSpec, ParallelSeams, PlanningTerms, ShapeRules


def check_args(args: ModelArgs) -> str | None:
    """Attention shapes the model cannot build: query heads that are not a multiple of the key/value
    heads, and an odd head dim (RoPE rotates halves)."""
    if args.n_heads % args.kv_heads:
        return f"n_heads {args.n_heads} is not a multiple of n_kv_heads {args.kv_heads}"
    if args.head_dim % 2:
        return f"head dim {args.head_dim} must be even for RoPE"
    return None


SPEC = ModelSpec(
    name="qwen3",
    model_cls=Transformer,
    flavors=qwen3_configs,
    units=qwen3_units,
    shape=ShapeRules(
        keys=SHAPE_KEYS,
        check_args=check_args,
        attn_mask_types=("causal", "block_causal"),
        tied_embeddings=lambda args: args.tie_embeddings,
    ),
    parallel=ParallelSeams(
        tp_plan=qwen3_tp_plan,
        tp_divisible=dense_tp_divisible,
        context_parallel=True,
    ),
    planning=PlanningTerms(
        activation_bytes=partial(activation_bytes, qk_norm=True), step_cost=partial(step_cost, qk_norm=True)
    ),
    hf_adapter=Qwen3HFAdapter(),
)

__all__ = ["SPEC", "ModelArgs", "Transformer", "qwen3_configs"]
