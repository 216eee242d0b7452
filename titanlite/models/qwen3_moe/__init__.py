"""Qwen3-MoE: the model, flavors, TP styles, activation model and HF adapter, on the MoE layer and load
balancing the MoE families share (`models/common/moe.py`, `moe_balance.py`)."""

from titanlite.models.common.moe_balance import aux_loss_term, check_layout, routing_metrics, update_routing_bias
from titanlite.models.qwen3_moe.activations import activation_bytes
from titanlite.models.qwen3_moe.flavors import qwen3_moe_configs
from titanlite.models.qwen3_moe.hf_adapter import Qwen3MoeHFAdapter
from titanlite.models.qwen3_moe.model import SHAPE_KEYS, ModelArgs, Transformer
from titanlite.models.qwen3_moe.parallelize import qwen3_moe_tp_styles
from titanlite.models.registry import ModelSpec, ParallelSeams, PlanningTerms, ShapeRules, TrainingHooks
from titanlite.parallelisms.units import Units


def check_args(args: ModelArgs) -> str | None:
    """Shapes the model cannot build: heads that do not divide each other, an odd head dim (RoPE rotates
    halves), more experts per token than experts."""
    if args.n_heads % args.kv_heads:
        return f"n_heads {args.n_heads} is not a multiple of n_kv_heads {args.kv_heads}"
    if args.head_dim % 2:
        return f"head dim {args.head_dim} must be even for RoPE"
    if not 0 < args.top_k <= args.num_experts:
        return f"top_k {args.top_k} must be between 1 and num_experts {args.num_experts}"
    return None


SPEC = ModelSpec(
    name="qwen3_moe",
    model_cls=Transformer,
    flavors=qwen3_moe_configs,
    units=lambda model: Units.of(model, "layers"),
    shape=ShapeRules(keys=SHAPE_KEYS, check_args=check_args, check_layout=check_layout, high_precision=("moe.gate",)),
    parallel=ParallelSeams(
        tp_styles=qwen3_moe_tp_styles,
        tp_divisible=lambda args: {
            "n_heads": args.n_heads,
            "n_kv_heads": args.kv_heads,
            # The dense layers' SwiGLU is split over tp (the experts are whole on every tp rank).
            **({"ffn_dim": args.ffn_dim} if not all(map(args.is_moe, range(args.n_layers))) else {}),
        },
        num_experts=lambda args: args.num_experts,
    ),
    hooks=TrainingHooks(
        extra_loss=aux_loss_term,
        extra_loss_across_stages=True,
        step_metrics=routing_metrics,
        after_step=update_routing_bias,
    ),
    planning=PlanningTerms(activation_bytes=activation_bytes),
    hf_adapter=Qwen3MoeHFAdapter(),
)

__all__ = ["SPEC", "ModelArgs", "Transformer", "qwen3_moe_configs"]
