"""DeepSeek-V3's planning terms: the activation model against MemTracker's measured peak on the debug model
(CPU, eager, fp32, the math attention kernel), and the parameter counts against `ModelArgs.num_params` (the
built model's) and the published totals.

Tolerance 3% for the activations: the model follows the saved tensors op by op (tests/unit/planning/
test_dry_run.py's measurement) and leaves out the routing's small index temporaries; the full-AC cases keep the
router statistics' graph (the activation model's docstring), so a fix there shows here as a failure.
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
    measured = measure_activation_peak(model, vocab, BATCH, SEQ, use_loss_parallel=False)
    layout = Layout(
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
    estimated = activation_bytes(args, layout)["peak"]
    assert abs(estimated - measured) <= TOLERANCE * measured, (estimated, measured)
    # Negative control: dropping the routed rows misses the measurement by far more than the tolerance.
    no_rows = activation_bytes(dataclasses.replace(args, top_k=0), layout)["peak"] if ac == "none" else 0
    assert no_rows == 0 or abs(no_rows - measured) > TOLERANCE * measured


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
