"""Llama 3: the model, its flavors, its blocks and tensor-parallel plan, its HF adapter, its activation model."""

from titanlite.models.common.dense_activations import activation_bytes
from titanlite.models.common.dense_cost import step_cost
from titanlite.models.common.tensor_parallel import dense_tp_divisible
from titanlite.models.llama3.flavors import llama3_configs
from titanlite.models.llama3.hf_adapter import LlamaHFAdapter
from titanlite.models.llama3.model import SHAPE_KEYS, ModelArgs, Transformer
from titanlite.models.llama3.parallelize import llama_tp_plan, llama_units
from titanlite.models.registry import ModelSpec, ParallelSeams, PlanningTerms, ShapeRules


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


SPEC = ModelSpec(
    name="llama3",
    model_cls=Transformer,
    flavors=llama3_configs,
    units=llama_units,
    shape=ShapeRules(
        keys=SHAPE_KEYS,
        check_args=check_args,
        attn_mask_types=("causal", "block_causal"),
        tied_embeddings=lambda args: args.tie_embeddings,
    ),
    parallel=ParallelSeams(
        tp_plan=llama_tp_plan,
        tp_divisible=dense_tp_divisible,
        context_parallel=True,
    ),
    planning=PlanningTerms(activation_bytes=activation_bytes, step_cost=step_cost),
    hf_adapter=LlamaHFAdapter(),
)

__all__ = ["SPEC", "ModelArgs", "Transformer", "llama3_configs"]
