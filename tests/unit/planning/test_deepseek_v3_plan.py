"""DeepSeek-V3's planning terms: the activation model against MemTracker's measured peak on the debug model
(CPU, eager, fp32, the math attention kernel), and the parameter counts against `ModelArgs.num_params` (the
built model's) and the published totals.

Tolerance 3% for the activations: the model follows the saved tensors op by op (tests/unit/planning/
test_dry_run.py's measurement, the step's loss with the family's auxiliary term) and leaves out the routing's
small index temporaries. Under full AC a MoE block keeps what it saved up to the router only with the auxiliary
loss on, whose graph the router's statistics carry to the loss (the activation model's docstring).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_dry_run import measure_activation_peak

from titanlite.config import ActivationCheckpoint
from titanlite.models.deepseek_v3 import SPEC, Transformer, deepseek_v3_configs
from titanlite.models.deepseek_v3.activations import activation_bytes
from titanlite.models.deepseek_v3.cost import step_cost
from titanlite.models.deepseek_v3.moe import DeepSeekMoE
from titanlite.parallelisms.activation_checkpoint import apply_ac
from titanlite.parallelisms.layout import Layout
from titanlite.parallelisms.parallel_dims import ParallelDims

TOLERANCE = 0.03
BATCH, SEQ = 4, 128


@pytest.mark.parametrize(
    ("ac", "vocab", "shape"),
    [
        ("none", 2048, {}),
        ("full", 2048, {}),
        ("full", 64, {}),  # small vocabulary: the last block's backward is the peak
        ("full", 2048, {"router_aux_loss_coef": 0.01}),  # the router statistics' graph kept to the loss
        ("none", 2048, {"q_lora_rank": 96}),  # the queries' latent
        ("none", 2048, {"score_func": "softmax", "n_group": 1, "n_shared_experts": 2}),
    ],
)
def test_activation_estimate_matches_measurement(ac, vocab, shape):
    args = dataclasses.replace(deepseek_v3_configs["debugmodel"], vocab_size=vocab, **shape)
    torch.manual_seed(0)
    model = Transformer(args, seq_len=SEQ)
    model.init_weights(0, torch.device("cpu"))
    apply_ac(SPEC.units(model).blocks, ActivationCheckpoint(ac, "op"))
    measured = measure_activation_peak(model, vocab, BATCH, SEQ, False, extra_loss=SPEC.hooks.extra_loss)
    layout = _layout(ac)
    estimated = activation_bytes(args, layout)["peak"]
    assert abs(estimated - measured) <= TOLERANCE * measured, (estimated, measured)
    # Negative control: dropping the routed rows misses the measurement by far more than the tolerance.
    no_rows = activation_bytes(dataclasses.replace(args, top_k=0), layout)["peak"] if ac == "none" else 0
    assert no_rows == 0 or abs(no_rows - measured) > TOLERANCE * measured


def _layout(ac: str) -> Layout:
    """One CPU process in fp32, the debug step's batch, AC `ac`."""
    return Layout(
        dims=ParallelDims(dp_replicate=1, dp_shard=1, tp=1, world_size=1),
        dp_mode=None,
        dp_impl="simple_fsdp",
        compute_dtype=torch.float32,
        reduce_dtype=torch.float32,
        reshard="default",
        loss_parallel=False,
        ac_mode=ac,
        ac_option="op",
        local_batch=BATCH,
        seq_len=SEQ,
        device_type="cpu",
    )


def _full_ac_peak(aux_coef: float) -> tuple[int, Transformer]:
    """The measured activation peak of a fully checkpointed debug step with this auxiliary loss weight."""
    args = dataclasses.replace(deepseek_v3_configs["debugmodel"], vocab_size=2048, router_aux_loss_coef=aux_coef)
    torch.manual_seed(0)
    model = Transformer(args, seq_len=SEQ)
    model.init_weights(0, torch.device("cpu"))
    apply_ac(SPEC.units(model).blocks, ActivationCheckpoint("full", "op"))
    return measure_activation_peak(model, 2048, BATCH, SEQ, False, extra_loss=SPEC.hooks.extra_loss), model


@pytest.mark.slow
def test_router_statistics_hold_no_graph_without_the_auxiliary_loss():
    """Without the auxiliary loss (the flavors') the router's statistics hold no graph, so full AC keeps each
    block's input only: the step's peak is under 60% of the same step with the loss on, which keeps every MoE
    block's norms, attention and router to the loss (measured 41.9 and 86.4 KB per token). That second step
    is the negative control: it is what the first measured while the statistics kept their graph regardless."""
    off, model = _full_ac_peak(0.0)
    on, model_on = _full_ac_peak(0.01)
    assert off < 0.6 * on, (off, on)
    estimated = activation_bytes(model.args, _layout("full"))["peak"]
    assert abs(estimated - off) <= TOLERANCE * off, (estimated, off)
    stats = [m.stats for m in model.modules() if isinstance(m, DeepSeekMoE)]
    assert stats and not any(s.prob_sum.requires_grad for s in stats)
    assert all(m.stats.prob_sum.requires_grad for m in model_on.modules() if isinstance(m, DeepSeekMoE))


def test_parameter_counts_match_the_built_model_and_the_published_totals():
    """num_params equals the meta-built model's elements (debug, 16B); 671B: 671e9 total and 37e9 active
    (DeepSeek-V3's model card; measured 671.03e9 and 37.55e9) within 0.5% and 2%; 16B: ~15.7e9 total and
    ~2.4e9 active (DeepSeek-V2-Lite's card; measured 15.71e9, and 2.45e9 without the input embedding, which
    the card's active count leaves out) within 1% and 5%. Multi-token prediction's module is not built."""
    for flavor in ("debugmodel", "16B"):
        args = deepseek_v3_configs[flavor]
        with torch.device("meta"):
            model = Transformer(args)
        assert sum(p.numel() for p in model.parameters()) == args.num_params(), flavor
    big, small = deepseek_v3_configs["671B"], deepseek_v3_configs["16B"]
    assert abs(big.num_params() / 671e9 - 1) < 0.005 and abs(big.num_params(active=True) / 37e9 - 1) < 0.02
    assert (
        abs(small.num_params() / 15.7e9 - 1) < 0.01
        and abs(small.num_params(exclude_embedding=True, active=True) / 2.4e9 - 1) < 0.05
    )


def test_step_cost_counts_the_active_experts_and_splits_what_tp_splits():
    """The block matmuls (mean over the blocks) times the layers, with the output projection, are 2 x the
    active parameters less the embedding; the routed experts and the router are what every tp rank runs whole."""
    args = deepseek_v3_configs["671B"]
    cost = step_cost(args, 4096, 2)
    matmuls = cost.block.matmul_flops * args.n_layers + cost.output_matmul_flops
    norms = args.n_layers * (2 * args.dim + args.q_lora_rank + args.kv_lora_rank) + args.dim
    assert matmuls == pytest.approx(2 * (args.num_params(exclude_embedding=True, active=True) - norms), rel=1e-9)
    moe = args.moe_layers / args.n_layers
    routed = args.top_k * 3 * args.dim * args.moe_ffn_dim + args.dim * args.num_experts
    assert cost.block.replicated_matmul_flops == pytest.approx(2 * moe * routed)
    assert cost.block.expert_parallel_elements == pytest.approx(moe * args.top_k * args.dim)
