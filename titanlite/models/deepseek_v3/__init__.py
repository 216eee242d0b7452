"""DeepSeek-V3: multi-head latent attention, DeepSeekMoE with aux-loss-free balancing, flavors and the
family's spec (docs/deepseek_v3.md)."""

from titanlite.models.common.moe_balance import check_layout
from titanlite.models.deepseek_v3.activations import activation_bytes
from titanlite.models.deepseek_v3.balance import aux_loss_term, routing_metrics, update_routing_bias
from titanlite.models.deepseek_v3.cost import step_cost
from titanlite.models.deepseek_v3.flavors import deepseek_v3_configs
from titanlite.models.deepseek_v3.hf_adapter import DeepseekV3HFAdapter
from titanlite.models.deepseek_v3.model import SHAPE_KEYS, ModelArgs, Transformer
from titanlite.models.deepseek_v3.parallelize import deepseek_v3_tp_styles
from titanlite.models.registry import ModelSpec, ParallelSeams, PlanningTerms, ShapeRules, TrainingHooks
from titanlite.parallelisms.units import Units


def check_args(args: ModelArgs) -> str | None:
    """Shapes the model cannot build: an odd rotary part (RoPE turns pairs), more experts per token than
    experts, groups that do not split the experts or hold too few of them."""
    if args.qk_rope_head_dim % 2:
        return f"qk_rope_head_dim {args.qk_rope_head_dim} must be even for RoPE"
    if args.num_experts <= 0:
        return None
    if not 0 < args.top_k <= args.num_experts:
        return f"top_k {args.top_k} must be between 1 and num_experts {args.num_experts}"
    if args.num_experts % args.n_group:
        return f"n_group {args.n_group} must divide num_experts {args.num_experts}"
    per_group = args.num_experts // args.n_group
    if args.n_group > 1 and per_group < 2:
        return f"group-limited routing needs at least 2 experts per group, {per_group} given"
    if not 0 < args.topk_group <= args.n_group or args.top_k > args.topk_group * per_group:
        return f"top_k {args.top_k} experts cannot come from topk_group {args.topk_group} groups of {per_group}"
    return None


SPEC = ModelSpec(
    name="deepseek_v3",
    model_cls=Transformer,
    flavors=deepseek_v3_configs,
    units=lambda model: Units.of(model, "layers"),
    shape=ShapeRules(
        keys=SHAPE_KEYS,
        check_args=check_args,
        check_layout=check_layout,
        attn_mask_types=("causal", "block_causal"),
        high_precision=("moe.gate",),
    ),
    parallel=ParallelSeams(
        tp_styles=deepseek_v3_tp_styles,
        tp_divisible=lambda args: {
            "n_heads": args.n_heads,
            # The dense layers' SwiGLU and the shared experts are split over tp (routed experts are whole).
            **({"ffn_dim": args.ffn_dim} if args.first_k_dense_replace or not args.num_experts else {}),
            **({"shared_ffn_dim": args.n_shared_experts * args.moe_ffn_dim} if args.moe_layers else {}),
        },
        context_parallel=True,
        num_experts=lambda args: args.num_experts,
    ),
    hooks=TrainingHooks(
        extra_loss=aux_loss_term,
        extra_loss_across_stages=True,
        step_metrics=routing_metrics,
        after_step=update_routing_bias,
    ),
    planning=PlanningTerms(activation_bytes=activation_bytes, step_cost=step_cost),
    hf_adapter=DeepseekV3HFAdapter(),
)

__all__ = ["SPEC", "ModelArgs", "Transformer", "deepseek_v3_configs"]
