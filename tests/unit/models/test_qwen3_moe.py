"""The Qwen3-MoE family on one process: the MoE layer against a plain per-token reference written here
(grouped GEMM and the expert loop, values and gradients), the auxiliary loss against its formula written
out, and the Hugging Face export against `transformers.Qwen3MoeForCausalLM` (logits, greedy generation,
the auxiliary loss) and back."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from builders import config

from titanlite.checkpoint import hf
from titanlite.errors import CheckpointError, ConfigError
from titanlite.models.common import moe as moe_module
from titanlite.models.common.moe import Experts, MoE, grouped_gemm_dtype
from titanlite.models.qwen3_moe import SPEC, ModelArgs, Transformer
from titanlite.planning.run_plan import RunPlan
from titanlite.tools.generate import generate

ARGS = dataclasses.replace(
    SPEC.flavors["debugmodel"], dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96,
    moe_ffn_dim=32, num_experts=8, top_k=2, vocab_size=257, max_seq_len=64,
)  # fmt: skip
"""Layer 0 dense (the flavor's mlp_only_layers), layers 1-2 MoE."""
SEQ = 16


def reference_moe(gate_w, gate_up, down, x: torch.Tensor, top_k: int, normalize: bool = True) -> torch.Tensor:
    """Plain PyTorch, one token at a time: softmax over the router, top-k, (renormalised) weights times
    each chosen expert's SwiGLU."""
    out = []
    for t in x.reshape(-1, x.shape[-1]):
        probs = F.softmax(gate_w @ t, dim=-1)
        weights, experts = probs.topk(top_k)
        weights = weights / weights.sum() if normalize else weights
        y = torch.zeros_like(t)
        for w, e in zip(weights, experts):
            gate, up = (gate_up[e] @ t).chunk(2)
            y = y + w * (down[e] @ (F.silu(gate) * up))
        out.append(y)
    return torch.stack(out).reshape(x.shape)


def model(args: ModelArgs = ARGS, seed: int = 0) -> Transformer:
    m = Transformer(args, seq_len=SEQ)
    m.init_weights(seed=seed)
    return m


def tokens(args: ModelArgs = ARGS) -> torch.Tensor:
    return torch.randint(0, args.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("grouped", [True, False])
def test_moe_layer_matches_a_per_token_reference(grouped):
    """Values and gradients, through `y.sum().backward()` (a zero-stride gradient, which grouped GEMM's
    backward rejects unless made contiguous); without renormalising the top-k weights (the negative
    control) the reference differs."""
    torch.manual_seed(0)
    moe = MoE(dim=32, hidden_dim=16, num_experts=8, top_k=2, norm_topk_prob=True, grouped=grouped)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(2, 12, 32, requires_grad=True)
    moe(x).sum().backward()
    grads = [x.grad, moe.gate.weight.grad, moe.experts.gate_up_proj.grad, moe.experts.down_proj.grad]
    x_ref = x.detach().clone().requires_grad_()
    params = [
        p.detach().clone().requires_grad_() for p in (moe.gate.weight, moe.experts.gate_up_proj, moe.experts.down_proj)
    ]
    expected = reference_moe(*params, x_ref, top_k=2)
    expected.sum().backward()
    torch.testing.assert_close(moe(x), expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, [x_ref.grad] + [p.grad for p in params]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(moe(x), reference_moe(*params, x_ref, top_k=2, normalize=False), atol=1e-3)
    assert moe.tokens_per_expert.sum() == 3 * 24 * 2  # three forwards of 24 tokens, two experts each


def record_grouped_gemms(monkeypatch) -> list[tuple[torch.Size, torch.Size, torch.dtype]]:
    """Every call of torch's grouped GEMM kernel from here on: (a's shape, b's shape, a's dtype)."""
    calls, kernel = [], torch._grouped_mm

    def record(a, b, *args, **kwargs):
        calls.append((a.shape, b.shape, a.dtype))
        return kernel(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", record)
    return calls


def experts_and_grads(experts: Experts, x: torch.Tensor, counts: torch.Tensor, grouped: bool) -> list[torch.Tensor]:
    """The output and the gradients of x and both weights of `experts` on x sorted by expert."""
    experts.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out = experts(x, counts, grouped)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return [out.detach(), x.grad, experts.gate_up_proj.grad, experts.down_proj.grad]


@pytest.mark.parametrize("rows", [(0, 0, 0, 0), (3, 0, 5, 0)], ids=["no-rows", "empty-experts"])
def test_experts_given_no_rows_call_no_grouped_gemm_over_an_empty_dim_and_get_zero_gradients(monkeypatch, rows):
    """A rank that receives no rows (expert parallelism with few tokens, or a router sending none there):
    the weight gradient's GEMM would contract over zero rows, which CUDA's kernel rejects; it is zeros
    without the kernel, and so are the empty forward and input gradient. Every kernel call is recorded;
    values and gradients match the experts' loop (the reference), and with no rows the weight gradients
    are zero. Experts without rows among others still run in the kernel (empty groups)."""
    torch.manual_seed(0)
    experts = Experts(num_experts=4, dim=32, hidden_dim=16)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.3)
    counts = torch.tensor(rows)
    x = torch.randn(sum(rows), 32)
    expected = experts_and_grads(experts, x, counts, grouped=False)
    calls = record_grouped_gemms(monkeypatch)
    got = experts_and_grads(experts, x, counts, grouped=True)
    assert len(calls) == (0 if sum(rows) == 0 else 6), calls  # 2 forward, 2 input and 2 weight gradients
    assert all(a[-1] > 0 for a, _, _ in calls), calls
    for g, want in zip(got, expected):
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)
    if sum(rows) == 0:
        assert not experts.gate_up_proj.grad.any() and not experts.down_proj.grad.any()


def test_grouped_gemm_runs_in_bf16_on_hopper_and_blackwell_the_loop_on_older_gpus_as_is_on_cpu(monkeypatch):
    """Where the experts run as grouped GEMMs and in which dtype (`grouped_gemm_dtype`): on CUDA torch's
    sync-free kernel takes bf16 on capability 9.x and 10.x, so fp32 compute casts to it; other GPUs run the
    loop (torch's fallback reads the offsets on the host in every call); the CPU kernel takes fp32 as is;
    rows whose byte stride is not a multiple of 16 run the loop."""
    cuda, cpu, f32, bf16 = torch.device("cuda", 0), torch.device("cpu"), torch.float32, torch.bfloat16
    cases = [((9, 0), f32, bf16), ((9, 0), bf16, bf16), ((10, 0), f32, bf16), ((8, 0), bf16, None)]
    cases += [((8, 6), f32, None), ((12, 0), bf16, None)]
    for capability, dtype, expected in cases:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert grouped_gemm_dtype(64, 128, 64, dtype=dtype, device=cuda) == expected, (capability, dtype)
        assert grouped_gemm_dtype(64, 128, 4, dtype=dtype, device=cuda) is None  # 8 bytes in bf16
    assert grouped_gemm_dtype(64, 128, 64, dtype=f32, device=cpu) == f32
    assert grouped_gemm_dtype(64, 128, 64, dtype=bf16, device=cpu) == bf16
    assert grouped_gemm_dtype(64, 128, 6, dtype=f32, device=cpu) is None  # 24 bytes


def test_fp32_experts_run_their_grouped_gemms_in_bf16_where_the_kernel_takes_only_bf16(monkeypatch):
    """Where `grouped_gemm_dtype` says bf16 (CUDA's kernel), fp32 experts cast their inputs and weights to
    bf16 for the GEMMs and the output back: fp32 values and gradients within bf16's precision of the fp32
    loop, every kernel call in bf16 (run here on the CPU kernel, which takes bf16 too)."""
    torch.manual_seed(0)
    experts = Experts(num_experts=4, dim=32, hidden_dim=16)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.3)
    counts, x = torch.tensor([3, 0, 5, 2]), torch.randn(10, 32)
    expected = experts_and_grads(experts, x, counts, grouped=False)
    monkeypatch.setattr(moe_module, "grouped_gemm_dtype", lambda *widths, dtype, device: torch.bfloat16)
    calls = record_grouped_gemms(monkeypatch)
    got = experts_and_grads(experts, x, counts, grouped=True)
    assert len(calls) == 6 and {dtype for _, _, dtype in calls} == {torch.bfloat16}
    for g, want in zip(got, expected):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, want, rtol=5e-2, atol=5e-2)
    assert not torch.allclose(got[0], expected[0], rtol=0, atol=1e-6)  # bf16 GEMMs: not the fp32 values


def test_aux_loss_is_the_load_balancing_formula():
    """The extra loss is coef x E x sum_e f_e P_e over every MoE layer's tokens together (f_e: top-k
    assignments per token, P_e: mean router probability), recomputed here from the router weights; a
    dense-only model adds nothing."""
    m = model()
    x = tokens()
    inputs = {}
    for i in (1, 2):
        m.layers[str(i)].ffn_norm.register_forward_hook(lambda mod, a, out, i=i: inputs.__setitem__(i, out))
    m(x)
    f, p, imbalance = torch.zeros(ARGS.num_experts), torch.zeros(ARGS.num_experts), 0.0
    for i in (1, 2):
        probs = F.softmax(inputs[i].reshape(-1, ARGS.dim) @ m.layers[str(i)].moe.gate.weight.T, dim=-1)
        counts = F.one_hot(probs.topk(ARGS.top_k).indices, ARGS.num_experts).sum((0, 1)).float()
        f, p, imbalance = f + counts, p + probs.sum(0), max(imbalance, (counts.max() / counts.mean()).item())
    rows = 2 * x.numel()
    expected = ARGS.router_aux_loss_coef * ARGS.num_experts * ((f / rows) * (p / rows)).sum()
    torch.testing.assert_close(SPEC.hooks.extra_loss(m), expected)
    metrics = SPEC.hooks.step_metrics(m)
    assert metrics["moe_aux_loss"] == pytest.approx(expected.item() / ARGS.router_aux_loss_coef, rel=1e-5)
    assert metrics["moe_load_imbalance"] == pytest.approx(imbalance, rel=1e-6) and imbalance > 1.0
    assert SPEC.hooks.step_metrics(m)["moe_load_imbalance"] == 0.0  # the counters were reset
    dense = model(dataclasses.replace(ARGS, mlp_only_layers=(0, 1, 2)))
    dense(x)
    assert SPEC.hooks.extra_loss(dense).item() == 0.0
    dense.routing_in = torch.zeros(3, ARGS.num_experts)  # a last pipeline stage after dense stages
    assert SPEC.hooks.extra_loss(dense).item() == 0.0


def test_pipeline_stages_hand_the_routing_on_so_the_aux_loss_covers_every_stage():
    """Two pipeline stages (`keep_stage`: the embedding and layers 0-1, then layer 2 and the output): the
    first returns its hidden states with its layers' routing sums, the last keeps them, and the last
    stage's extra loss equals the whole model's, with the same gradient in the first stage's router; the
    last stage handed nothing (the control) misses layer 1's routing."""
    from titanlite.config import Parallelism
    from titanlite.parallelisms.pipeline.unit import StageLayout, keep_stage

    whole, x = model(), tokens()
    plan = StageLayout.of(Parallelism(pipeline_parallel_degree=2), ARGS.n_layers, local_batch=2)
    stages = [copy.deepcopy(whole) for _ in range(2)]
    for i, stage in enumerate(stages):
        keep_stage(stage, SPEC.units(stage), plan, i)
    assert list(stages[0].layers) == ["0", "1"] and list(stages[1].layers) == ["2"]
    whole(x)
    expected = SPEC.hooks.extra_loss(whole)
    expected.backward()
    h, routing = stages[0](x)
    stages[1](h, routing)
    got = SPEC.hooks.extra_loss(stages[1])
    got.backward()
    torch.testing.assert_close(got, expected)
    gate = "layers.1.moe.gate.weight"
    assert whole.get_parameter(gate).grad.abs().max() > 0
    torch.testing.assert_close(stages[0].get_parameter(gate).grad, whole.get_parameter(gate).grad)
    stages[1](h.detach())
    assert not torch.allclose(SPEC.hooks.extra_loss(stages[1]), expected, rtol=1e-3)


def test_fsdp2_hands_a_stage_its_carried_routing_sums_unrounded(process_group):
    """FSDP2 in bf16 casts each block's inputs to the compute dtype but not the root's: a later pipeline
    stage receives the routing sums in float32 (in bf16 a count of 257 would arrive as 256)."""
    from torch.distributed.device_mesh import init_device_mesh

    from titanlite.config import Parallelism
    from titanlite.parallelisms.data_parallel.fsdp2 import apply_fsdp2
    from titanlite.parallelisms.data_parallel.reshard import ReshardPolicy
    from titanlite.parallelisms.pipeline.unit import StageLayout, keep_stage

    stage = model()
    keep_stage(stage, SPEC.units(stage), StageLayout.of(Parallelism(pipeline_parallel_degree=2), 3, local_batch=2), 1)
    units = SPEC.units(stage)
    reshard = ReshardPolicy.of("default", len(units.blocks))
    apply_fsdp2(stage, units, init_device_mesh("cpu", (1,)), torch.bfloat16, torch.float32, reshard)
    routing = torch.tensor([[257.0] * 8, [1.5] * 8, [300.0] * 8])
    stage(torch.randn(2, SEQ, ARGS.dim, dtype=torch.bfloat16), routing)
    assert stage.routing_in.dtype == torch.float32 and torch.equal(stage.routing_in, routing)


def test_transformers_loads_the_export(tmp_path):
    """`Qwen3MoeForCausalLM` loads the export: logits within 1e-4, the same greedy tokens and the same
    auxiliary loss; the export imported back gives identical logits."""
    transformers = pytest.importorskip("transformers")
    src = model(seed=1)
    hf.export_hf(src, tmp_path / "hf", adapter=SPEC.hf_adapter, bos_id=1, eos_id=2)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    assert type(theirs).__name__ == "Qwen3MoeForCausalLM"
    theirs.eval()
    x = tokens()
    with torch.no_grad():
        out = theirs(x, output_router_logits=True)
        ours = src(x)
        torch.testing.assert_close(out.logits, ours, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out.aux_loss * ARGS.router_aux_loss_coef, SPEC.hooks.extra_loss(src))
        prompt = x[0, :5].tolist()
        want = theirs.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
        assert generate(src, prompt, 8) == want[0, 5:].tolist()
    dst = model(seed=2)
    hf.import_hf(dst, tmp_path / "hf", adapter=SPEC.hf_adapter)
    with torch.no_grad():
        assert torch.equal(dst(x), ours)


def test_aux_loss_free_balancing_routes_with_the_bias_and_moves_it_towards_the_mean(tmp_path):
    """The bias chooses the experts, the probabilities weight them; after a step the bias of an expert
    below the mean count rises by the rate, above it falls; it is in the state dict (checkpoints) and
    the export is refused."""
    args = dataclasses.replace(ARGS, router_bias_update_rate=0.25)
    m = model(args)
    moe = m.layers["1"].moe
    moe.expert_bias[3] = 10.0
    x = torch.randn(40, ARGS.dim)
    probs, weights, experts = moe.route(x)
    assert (experts == 3).any(dim=-1).all()
    chosen = probs.gather(-1, experts)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True))
    m(tokens())
    counts = moe.step_tokens.clone()
    assert counts[3] == 2 * SEQ * 1  # every token of both sequences picked expert 3 once
    before = moe.expert_bias.clone()
    SPEC.hooks.after_step(m)
    expected = before + 0.25 * torch.sign(counts.mean() - counts)
    torch.testing.assert_close(moe.expert_bias, expected)
    assert moe.step_tokens.sum() == 0 and "layers.1.moe.expert_bias" in m.state_dict()
    with pytest.raises(CheckpointError, match="router_bias_update_rate"):
        hf.export_hf(m, tmp_path / "hf", adapter=SPEC.hf_adapter, bos_id=1, eos_id=2)
    plain = model()
    assert plain.layers["1"].moe.expert_bias is None and "layers.1.moe.expert_bias" not in plain.state_dict()


@pytest.mark.parametrize(
    ("keys", "error"),
    [
        ({"model__top_k": 9}, "top_k 9 must be between 1 and num_experts 8"),
        (
            {"model__router_bias_update_rate": 0.01, "parallelism__pipeline_parallel_degree": 2},
            "aux-loss-free balancing .* does not combine with pipeline_parallel_degree > 1",
        ),
    ],
)
def test_what_the_family_does_not_support_is_refused_before_any_rank_starts(keys, error):
    cfg = config(None, {"model__name": "qwen3_moe"}, **keys)
    with pytest.raises(ConfigError, match=error):
        RunPlan.build(cfg, 2)
    RunPlan.build(config(None, {"model__name": "qwen3_moe"}, parallelism__pipeline_parallel_degree=2), 2)


def test_moe_experts_chooses_the_expert_loop_and_applies_to_moe_families_only():
    """`model.moe_experts = "loop"` builds the experts as the loop (the grouped GEMM is the default); a
    family without experts refuses the key rather than ignoring it."""
    plan = RunPlan.build(config(None, {"model__name": "qwen3_moe"}), 1)
    assert plan.model_args.grouped_mm
    plan = RunPlan.build(config(None, {"model__name": "qwen3_moe", "model__moe_experts": "loop"}), 1)
    assert not plan.model_args.grouped_mm
    moes = [layer.moe for layer in Transformer(plan.model_args, 16).layers.values() if hasattr(layer, "moe")]
    assert moes and not any(moe.grouped for moe in moes)
    with pytest.raises(ConfigError, match="'model.moe_experts' does not apply to llama3"):
        RunPlan.build(config(None, {"model__moe_experts": "loop"}), 1)


@pytest.mark.slow
def test_the_debug_config_trains_on_two_ranks_matches_one_and_resumes_compiled(tmp_path):
    """`run_train.sh --config train_configs/qwen3_moe_debug.toml` on 2 ranks (SimpleFSDP): the MoE
    metrics on the step line, in metrics.jsonl and TensorBoard; one process accumulating the same two
    microbatches gives the same losses (the auxiliary loss is per microbatch), with aux-loss-free
    balancing on; a resume at step 2, compiled under FSDP2 and full AC, continues the same losses."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from harness import SMALL, train

    config = "train_configs/qwen3_moe_debug.toml"
    # Aux-loss-free balancing on, with a rate large enough to change the routing within 4 steps: the
    # counts all-reduced over the ranks, the bias saved and resumed.
    bias = ["--model.router_bias_update_rate", "0.05"]
    common = [*SMALL[:-1], *bias, "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "2"]
    two = train(tmp_path / "two", 2, *common, config=config, launcher="run_train").ok()
    assert "moe_load_imbalance: " in two.log and "moe_aux_loss: " in two.log
    rows = two.metrics
    assert len(rows) == 4 and all(r["moe_load_imbalance"] >= 1.0 and r["moe_aux_loss"] > 0 for r in rows)
    [run] = (tmp_path / "two" / "tb").iterdir()
    board = EventAccumulator(str(run))
    board.Reload()
    assert {"moe/moe_aux_loss", "moe/moe_load_imbalance"} <= set(board.Tags()["tensors"])
    one = train(tmp_path / "one", 1, *SMALL[:-1], *bias, "--training.steps", "4", "--training.global_batch_size", "4",
                config=config).ok()  # fmt: skip
    assert "accum 2" in one.log
    assert one.losses == pytest.approx(two.losses, rel=1e-5)
    (tmp_path / "two" / "checkpoint" / "step-4").rename(tmp_path / "step-4")
    resumed = train(
        tmp_path / "two", 2, *common, "--parallelism.dp_impl", "fsdp2", "--compile.enable",
        "--compile.backend", "aot_eager", "--activation_checkpoint.mode", "full", config=config,
    ).ok()  # fmt: skip
    assert "resumed from" in resumed.log
    again = [(r["step"], r["loss"]) for r in resumed.metrics if r["run"] == 2]
    assert again == [(3, pytest.approx(two.losses[2], rel=1e-5)), (4, pytest.approx(two.losses[3], rel=1e-5))], (
        again,
        two.losses,
        resumed.log[-3000:],
    )
