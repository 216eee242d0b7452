"""DeepSeek-V3: shapes and forward, the latent attention and the router against plain PyTorch references
written here, the balancing bias's update against its formula, what the family refuses, the debug flavor
learning, and (slow) checkpoints resumed exactly and across expert-parallel degrees through the trainer.

Tolerances: fp32 references agree within 1e-5 (relative and absolute); resumes on the same layout are
bitwise, across the ep degree within the harness's relative 1e-5.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from builders import config

from harness import LOSS_REL, SMALL, assert_resumed, copy_checkpoint, train_in_one_launch
from harness import max_rel as rel
from harness import step_metric as losses
from harness import train as run_trainer
from titanlite.config import load_config
from titanlite.errors import ConfigError
from titanlite.models.deepseek_v3 import SPEC, ModelArgs, Transformer, deepseek_v3_configs
from titanlite.models.deepseek_v3.attention import MultiHeadLatentAttention
from titanlite.models.deepseek_v3.moe import DeepSeekMoE
from titanlite.models.deepseek_v3.rope import YaRN, rope, softmax_scale
from titanlite.parallelisms.parallel_dims import ParallelDims
from titanlite.planning.run_plan import RunPlan

ARGS = dataclasses.replace(deepseek_v3_configs["debugmodel"], dim=64, n_heads=4, ffn_dim=128, moe_ffn_dim=32)
ARGS = dataclasses.replace(ARGS, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
ARGS = dataclasses.replace(ARGS, n_layers=3, vocab_size=257, max_seq_len=64)
SEQ = 16


def model(args: ModelArgs = ARGS, seed: int = 0) -> Transformer:
    with torch.device("meta"):
        m = Transformer(args, seq_len=SEQ)
    m.to_empty(device="cpu")
    m.init_weights(seed)
    return m


def tokens(args: ModelArgs = ARGS, batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, args.vocab_size, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def randomize(module: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def test_module_tree_and_parameter_count():
    """The design's names (no query latent in the debug flavor, one in 671B), and `num_params` counts
    what is built, for every flavor (on the meta device)."""
    m = model()
    names = set(dict(m.named_parameters()))
    assert {"layers.0.attention.wq.weight", "layers.0.feed_forward.w1.weight", "output.weight"} <= names
    assert {
        "layers.1.moe.gate.weight",
        "layers.1.moe.experts.gate_up_proj",
        "layers.1.moe.shared_experts.w2.weight",
    } <= names
    assert "layers.1.moe.expert_bias" in m.state_dict() and "layers.0.moe.gate.weight" not in names
    assert m(tokens()).shape == (2, SEQ, ARGS.vocab_size)
    for name, args in deepseek_v3_configs.items():
        args = dataclasses.replace(args, n_layers=max(args.first_k_dense_replace + 1, 2), vocab_size=1000)
        with torch.device("meta"):
            built = Transformer(args, seq_len=8)
        assert sum(p.numel() for p in built.parameters()) == args.num_params(), name
        assert SPEC.shape.check_args(args) is None
    big = deepseek_v3_configs["671B"]
    assert round(big.num_params() / 1e9) == 671 and round(big.num_params(active=True) / 1e9) == 38
    with torch.device("meta"):
        attn = Transformer(dataclasses.replace(big, n_layers=1, vocab_size=8), seq_len=8).layers["0"].attention
    assert attn.wq_a.weight.shape == (1536, 7168) and attn.wq_b.weight.shape == (128 * 192, 1536)
    assert attn.wkv_a.weight.shape == (576, 7168) and attn.wkv_b.weight.shape == (128 * 256, 512)


def reference_yarn_freqs(dim: int, theta: float, y: YaRN) -> torch.Tensor:
    """YaRN's frequencies as the paper's reference code blends them (written out here)."""
    base = torch.tensor([theta ** (-i / dim) for i in range(0, dim, 2)], dtype=torch.float64)

    def corr(rot: float) -> float:
        return dim * math.log(y.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(corr(y.beta_fast)), 0), min(math.ceil(corr(y.beta_slow)), dim - 1)
    out = []
    for i, f in enumerate(base.tolist()):
        r = min(max((i - low) / max(high - low, 1e-3), 0.0), 1.0)  # 0: keep, 1: interpolate
        out.append(f / y.factor * r + f * (1 - r))
    return torch.tensor(out, dtype=torch.float64)


def reference_mla(attn, x, q_lora: bool, yarn: YaRN | None, mscale_scores: bool = True) -> torch.Tensor:
    """Latent attention in plain PyTorch: down/up projections, RMSNorm of the latents, RoPE on the rope part
    as complex rotations of interleaved pairs, scores scaled by qk_head_dim^-1/2 (times YaRN's mscale^2),
    causal softmax."""
    b, s, _ = x.shape
    h, nope, rp, vd, r = 4, 16, 8, 16, 32

    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    q = rms(x @ attn.wq_a.weight.T, attn.q_norm.weight) @ attn.wq_b.weight.T if q_lora else x @ attn.wq.weight.T
    q = q.view(b, s, h, nope + rp)
    kv = x @ attn.wkv_a.weight.T
    latent, k_pe = kv[..., :r], kv[..., r:]
    kv = (rms(latent, attn.kv_norm.weight) @ attn.wkv_b.weight.T).view(b, s, h, nope + vd)
    freqs = reference_yarn_freqs(rp, 10000.0, yarn) if yarn else 1.0 / 10000.0 ** (torch.arange(0, rp, 2) / rp)
    m = 1.0
    if yarn:
        m = (0.1 * yarn.mscale * math.log(yarn.factor) + 1) / (0.1 * yarn.mscale_all_dim * math.log(yarn.factor) + 1)
    rot = torch.polar(torch.full((s, rp // 2), m, dtype=torch.float64), torch.outer(torch.arange(s).double(), freqs))

    def turn(t):  # [b, s, heads, rp] as rp // 2 complex pairs
        c = torch.view_as_complex(t.double().reshape(*t.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(c * rot[None, :, None, :]).flatten(-2).float()

    q = torch.cat([q[..., :nope], turn(q[..., nope:])], -1)
    k = torch.cat([kv[..., :nope], turn(k_pe[:, :, None, :]).expand(b, s, h, rp)], -1)
    v = kv[..., nope:]
    scale = (nope + rp) ** -0.5
    if yarn and mscale_scores:
        scale *= (0.1 * yarn.mscale_all_dim * math.log(yarn.factor) + 1) ** 2
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, s, h * vd)
    return out @ attn.wo.weight.T


@pytest.mark.parametrize("q_lora", [False, True], ids=["wq", "query-latent"])
@pytest.mark.parametrize(
    "yarn", [None, YaRN(factor=40, original_max_position_embeddings=4, mscale=1.0, mscale_all_dim=0.5)]
)
def test_latent_attention_matches_a_plain_reference(q_lora, yarn):
    r = rope(8, 10000.0, yarn)
    attn = MultiHeadLatentAttention(64, 4, 24 if q_lora else 0, 32, 16, 8, 16, r.rotate, softmax_scale(24, yarn), 1e-6)
    randomize(attn)
    x = torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(1))
    cos, sin = r.tables(SEQ)
    torch.testing.assert_close(attn(x, cos, sin), reference_mla(attn, x, q_lora, yarn), rtol=1e-5, atol=1e-5)
    if yarn is not None:  # negative control: the scores' mscale^2 matters
        assert not torch.allclose(attn(x, cos, sin), reference_mla(attn, x, q_lora, yarn, False), atol=1e-3)


def reference_route(scores, bias, n_group, topk_group, top_k, scaling):
    """Per token: groups ranked by the sum of their two best biased scores, the best top_k biased scores of
    the kept groups, weighted by the unbiased scores normalised to 1, times the scaling."""
    out = []
    per = len(bias) // n_group
    for row in scores:
        biased = (row + bias).tolist()
        groups = sorted(range(n_group), key=lambda g: -sum(sorted(biased[g * per : (g + 1) * per])[-2:]))
        eligible = [e for g in groups[:topk_group] for e in range(g * per, (g + 1) * per)]
        chosen = sorted(eligible, key=lambda e: -biased[e])[:top_k]
        total = sum(row[e].item() for e in chosen)
        out.append({e: row[e].item() / total * scaling for e in chosen})
    return out


def test_routing_matches_a_plain_reference_the_bias_choosing_only():
    moe = DeepSeekMoE(
        64, 32, 8, 2, n_shared_experts=1, score_func="sigmoid", n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, grouped=False, count_steps=True,
    )  # fmt: skip
    randomize(moe)
    moe.expert_bias = torch.tensor([0.0, 0.3, -0.2, 0.0, 0.5, 0.0, -0.4, 0.1])
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(2))
    _, weights, experts = moe.route(x)
    scores = torch.sigmoid(x @ moe.gate.weight.T)
    expected = reference_route(scores, moe.expert_bias, 4, 2, 2, 2.5)
    got = [dict(zip(e.tolist(), w.tolist())) for e, w in zip(experts, weights)]
    assert [set(g) for g in got] == [set(e) for e in expected]
    for g, e in zip(got, expected):
        assert g == pytest.approx(e, rel=1e-5)
    # Negative control: without the bias (or without the groups) other experts win for some tokens.
    assert [set(e) for e in reference_route(scores, torch.zeros(8), 4, 2, 2, 2.5)] != [set(e) for e in expected]
    assert [set(e) for e in reference_route(scores, moe.expert_bias, 1, 1, 2, 2.5)] != [set(e) for e in expected]
    # The layer: the routed experts' weighted SwiGLUs plus the shared expert, per token.
    out = moe(x[None])[0]
    w = moe.experts
    for t in (0, 17):
        want = sum(
            c * (F.silu(x[t] @ w.gate_up_proj[e, :32].T) * (x[t] @ w.gate_up_proj[e, 32:].T)) @ w.down_proj[e].T
            for e, c in expected[t].items()
        )
        s = moe.shared_experts
        want = want + (F.silu(x[t] @ s.w1.weight.T) * (x[t] @ s.w3.weight.T)) @ s.w2.weight.T
        torch.testing.assert_close(out[t], want, rtol=1e-5, atol=1e-5)


def test_bias_update_moves_each_bias_towards_the_mean_load():
    """After a step every MoE layer's bias moves by rate x sign(mean load - load), the loads being the
    tokens each expert was chosen by in the step's training forwards (counted here from the router's
    choices); a rate of 0 keeps the bias as loaded and counts nothing."""
    m = model()
    layers = {i: m.layers[str(i)].moe for i in range(1, ARGS.n_layers)}
    loads = {i: torch.zeros(ARGS.num_experts) for i in layers}
    for i, moe in layers.items():
        moe.expert_bias[:] = torch.linspace(-0.01, 0.01, ARGS.num_experts)

        def route(x, moe=moe, route=moe.route, load=loads[i]):
            out = route(x)
            if moe.training:
                load += torch.bincount(out[2].flatten(), minlength=ARGS.num_experts)
            return out

        moe.route = route
    before = {i: moe.expert_bias.clone() for i, moe in layers.items()}
    for seed in (0, 1):  # two microbatches in one step
        m(tokens(seed=seed))
    with torch.no_grad():
        m.eval()(tokens(seed=2))  # not training: not counted
    m.train()
    SPEC.hooks.after_step(m)
    for i, moe in layers.items():
        assert loads[i].sum() == 2 * 2 * SEQ * ARGS.top_k
        mean = loads[i].sum() / ARGS.num_experts
        expected = before[i] + ARGS.router_bias_update_rate * torch.sign(mean - loads[i])
        torch.testing.assert_close(moe.expert_bias, expected)
        assert loads[i].max() > mean  # the loads are uneven: the update is not a no-op
        # Negative control: the opposite sign (towards the busy experts) is not what happened.
        assert not torch.allclose(
            moe.expert_bias, before[i] - ARGS.router_bias_update_rate * torch.sign(mean - loads[i])
        )
        assert moe.step_tokens.sum() == 0
    spread = max((moe.expert_bias.max() - moe.expert_bias.min()).item() for moe in layers.values())
    metrics = SPEC.hooks.step_metrics(m)
    assert metrics["moe_bias_spread"] == pytest.approx(spread) and metrics["moe_load_imbalance"] > 1
    fixed = model(dataclasses.replace(ARGS, router_bias_update_rate=0.0))
    fixed.layers["1"].moe.expert_bias[0] = 0.5
    fixed(tokens())
    SPEC.hooks.after_step(fixed)
    assert fixed.layers["1"].moe.expert_bias[0] == 0.5 and fixed.layers["1"].moe.step_tokens is None


def test_generation_with_the_kv_cache_equals_recomputing():
    m = model().eval()
    t = tokens(batch=1)
    with torch.no_grad():
        full = m(t[:, :10])
        cache = m.new_cache(1, SEQ)
        steps = [m(t[:, :8], cache=cache), m(t[:, 8:9], cache=cache), m(t[:, 9:10], cache=cache)]
    assert cache.k[0].shape[-1] == 24 and cache.v[0].shape[-1] == 16
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_block_causal_runs_each_document_alone():
    """With positions and a document mask, a packed row's logits are each document's alone."""
    from titanlite.models.common.attention import build_mask

    m = model().eval()
    t = tokens(batch=1)
    positions = torch.cat([torch.arange(6), torch.arange(SEQ - 6)])[None]
    with torch.no_grad():
        packed = m(t, positions=positions, mask=build_mask("block_causal", positions))
        apart = torch.cat([m(t[:, :6]), m(t[:, 6:])], 1)
        whole = m(t)
    torch.testing.assert_close(packed, apart, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(packed[:, 6:], whole[:, 6:], atol=1e-3)


@pytest.mark.slow
def test_debug_flavor_loss_falls():
    """The debug flavor (bundled vocabulary size) learns a fixed batch: 20 AdamW steps more than halve
    the loss."""
    args = dataclasses.replace(deepseek_v3_configs["debugmodel"], vocab_size=2048)
    torch.manual_seed(0)
    m = model(args)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    t = tokens(args, batch=4)
    first = last = None
    for _ in range(20):
        loss = F.cross_entropy(m(t[:, :-1]).flatten(0, 1), t[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        SPEC.hooks.after_step(m)
        first, last = first or loss.item(), loss.item()
    assert last < first / 2, (first, last)


@pytest.mark.parametrize(
    "keys,error",
    [
        ({"model__top_k": 9}, "top_k 9 must be between 1 and num_experts 8"),
        ({"model__num_experts": 7}, "n_group 2 must divide num_experts 7"),
        ({"parallelism__pipeline_parallel_degree": 2}, "pipeline_parallel_degree > 1"),
        ({"parallelism__tensor_parallel_degree": 3}, "n_heads"),
    ],
)
def test_what_the_family_does_not_support_is_refused_before_any_rank_starts(keys, error):
    with pytest.raises(ConfigError, match=error):
        RunPlan.build(config(None, {"model__name": "deepseek_v3"}, **keys), 6 if "tensor" in str(keys) else 2)


@pytest.mark.parametrize("name,world", [("deepseek_v3_debug", 2), ("deepseek_v3_16b", 8), ("deepseek_v3_671b", 256)])
def test_shipped_configs_plan_a_layout_the_family_takes(name, world):
    cfg = load_config(["--config", f"train_configs/{name}.toml"])
    args = SPEC.flavors[cfg.model.flavor]
    dims = ParallelDims.from_config(cfg.parallelism, world, SPEC.parallel.tp_divisible(args))
    assert SPEC.shape.check_args(args) is None and SPEC.shape.check_layout(args, dims) is None
    assert args.num_experts % dims.ep == 0


# Slow: through the trainer (torchrun, gloo, fp32, deterministic), the debug config cut to 3 blocks.
CONFIG = "train_configs/deepseek_v3_debug.toml"
STEPS, SAVE_AT = 4, 2
EP2 = ["--parallelism.expert_parallel_degree", "2"]


def overrides(*extra: str) -> list[str]:
    steps = ["--training.steps", str(STEPS), "--training.global_batch_size", "4", "--model.n_layers", "3"]
    return [*SMALL, *steps, "--checkpoint.enable", "--checkpoint.interval", str(SAVE_AT), *extra]


@pytest.fixture(scope="module")
def resumes(tmp_path_factory):
    """dp2 uninterrupted, then its step-2 checkpoint resumed on dp2 and on dp2 x ep2 in one launch."""
    root = tmp_path_factory.mktemp("deepseek_resume")
    ref = run_trainer(root / "dp2", 2, *overrides(), config=CONFIG).ok()
    runs = [
        (copy_checkpoint(ref.dump, root / "on_dp2", SAVE_AT), overrides()),
        (copy_checkpoint(ref.dump, root / "on_ep2", SAVE_AT), overrides(*EP2)),
    ]
    out = {dump.name: r for dump, r in train_in_one_launch(runs, 2, CONFIG).items()}
    for r in out.values():
        assert_resumed(r, SAVE_AT)
    return ref, out


@pytest.mark.slow
def test_resume_is_exact_with_the_balancing_bias(resumes):
    """The step-2 checkpoint (weights, optimizer, the routing bias) resumed on dp2 gives the uninterrupted
    run's steps 3-4 bitwise, and the bias really moved."""
    ref, out = resumes
    want = {s: v for s, v in losses(ref.dump).items() if s > SAVE_AT}
    assert losses(out["on_dp2"].dump) == want
    assert losses(ref.dump, "moe_bias_spread")[STEPS] > 0


@pytest.mark.slow
def test_resume_across_expert_parallel_degrees(resumes):
    """The dp2 checkpoint resumed with the experts split over ep2 continues the run (relative 1e-5)."""
    ref, out = resumes
    assert "experts over ep 2" in out["on_ep2"].log
    got = losses(out["on_ep2"].dump)
    assert sorted(got) == [3, 4] and rel(got, losses(ref.dump)) <= LOSS_REL
