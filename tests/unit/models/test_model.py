"""Llama 3 model: flavor shapes on the meta device, FLOPs, RoPE, layout-independent init, projection order."""

from __future__ import annotations

import pytest
import torch

from titanlite.models.common.attention import attend
from titanlite.models.common.grouped_query_attention import GroupedQueryAttention
from titanlite.models.common.init import InitSpec, init_parameter_
from titanlite.models.common.rope_pairs import apply_rope
from titanlite.models.llama3 import ModelArgs, Transformer, llama3_configs
from titanlite.models.llama3.model import attention
from titanlite.models.llama3.rope import rope_tables

PUBLISHED = {"8B": 8.03e9, "70B": 70.55e9, "405B": 405.85e9}


@pytest.mark.parametrize("flavor", ["8B", "70B", "405B"])
def test_flavor_shapes_on_meta(flavor):
    args = llama3_configs[flavor]
    with torch.device("meta"):
        model = Transformer(args, seq_len=128)
    n = sum(p.numel() for p in model.parameters())
    assert n == args.num_params()
    assert abs(n - PUBLISHED[flavor]) / PUBLISHED[flavor] < 1e-3
    wq = model.layers["0"].attention.wq.weight
    wk = model.layers["0"].attention.wk.weight
    assert wq.shape == (args.dim, args.dim) and wk.shape == (8 * args.head_dim, args.dim)
    assert model.layers["0"].feed_forward.w1.weight.shape[0] == {"8B": 14336, "70B": 28672, "405B": 53248}[flavor]


def test_debug_model_forward_and_flops():
    args = ModelArgs(**{**llama3_configs["debugmodel"].__dict__, "vocab_size": 300})
    model = Transformer(args, seq_len=32)
    model.init_weights(seed=0)
    out = model(torch.randint(0, 300, (2, 32)))
    assert out.shape == (2, 32, 300)
    assert args.flops_per_token(32) > 6 * args.num_params(exclude_embedding=True)


def test_init_is_deterministic_and_seed_dependent():
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=50, multiple_of=16)
    a, b, c = Transformer(args, 8), Transformer(args, 8), Transformer(args, 8)
    a.init_weights(1), b.init_weights(1), c.init_weights(2)
    for (n, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), n
        if "norm" not in n:
            assert not torch.equal(p, r), n


@pytest.mark.parametrize("shape,rows,cols", [((300, 70), (100, 150), (10, 40)), ((257,), (128, 257), None)])
def test_init_of_a_block_equals_the_slice_of_the_full_tensor(monkeypatch, shape, rows, cols):
    """A rank that holds rows [r0, r1) x cols [c0, c1) gets exactly that slice of the full init."""
    import titanlite.models.common.init as init_mod

    monkeypatch.setattr(init_mod, "CHUNK_ELEMENTS", 1000)  # many chunks, so blocks straddle them
    spec = InitSpec("trunc_normal", std=0.02)
    full = torch.empty(shape)
    init_parameter_(full, spec, 7, "w")
    r0, r1 = rows
    c0, c1 = cols or (0, 1)

    local = torch.empty((r1 - r0,) + ((c1 - c0,) if len(shape) == 2 else ()))
    monkeypatch.setattr(init_mod, "local_block", lambda p: (local, (r0, c0) if len(shape) == 2 else (r0,)))
    meta = torch.empty(shape, device="meta")
    init_parameter_(meta, spec, 7, "w")
    expected = full[r0:r1, c0:c1] if len(shape) == 2 else full[r0:r1]
    assert torch.equal(local, expected)


def test_rope_rotation_preserves_norm_and_relative_positions():
    args = ModelArgs(dim=64, n_heads=4, rope_theta=10000.0)
    cos, sin = rope_tables(args, 16)
    q = torch.randn(1, 16, 1, 16)
    k = torch.randn(1, 16, 1, 16)
    rq = apply_rope(q, cos, sin)
    assert torch.allclose(rq.norm(dim=-1), q.norm(dim=-1), atol=1e-5)
    # <R_m q, R_n k> depends only on m - n: shift both by one position.
    qs, ks = q[:, :1].expand(1, 16, 1, 16), k[:, :1].expand(1, 16, 1, 16)
    a, b = apply_rope(qs, cos, sin), apply_rope(ks, cos, sin)
    assert torch.allclose((a[0, 3] * b[0, 1]).sum(), (a[0, 5] * b[0, 3]).sum(), atol=1e-4)


def test_scaled_rope_changes_only_low_frequencies():
    base = ModelArgs(dim=128, n_heads=1)
    cos_a, _ = rope_tables(base, 4096)
    cos_b, _ = rope_tables(ModelArgs(dim=128, n_heads=1, use_scaled_rope=True), 4096)
    assert torch.allclose(cos_a[:, :8], cos_b[:, :8]) and not torch.allclose(cos_a[:, -8:], cos_b[:, -8:])


def _debug_args() -> ModelArgs:
    return ModelArgs(**{**llama3_configs["debugmodel"].__dict__, "vocab_size": 300})


def _input_grad(attn: GroupedQueryAttention, x: torch.Tensor, grad: torch.Tensor, order: str) -> torch.Tensor:
    """x's gradient through plain-PyTorch attention with `attn`'s weights, its projections made in `order`."""
    x = x.detach().requires_grad_()
    bsz, seq, _ = x.shape
    cos, sin = rope_tables(_debug_args(), seq)
    heads = {n: getattr(attn, f"w{n}")(x).view(bsz, seq, -1, attn.head_dim) for n in order}
    q, k = apply_rope(heads["q"], cos, sin), apply_rope(heads["k"], cos, sin)
    out = attend(*(t.transpose(1, 2) for t in (q, k, heads["v"])), None)
    attn.wo(out.transpose(1, 2).reshape(bsz, seq, -1)).backward(grad)
    return x.grad


def test_attention_projects_queries_first():
    """Without context parallelism the queries are projected before the keys and values: autograd sums
    the input's gradient in the order of the projections, and the default run's losses (5.2789 at step
    50, 5.0853 at step 100) hold in that order only. The negative control: another order, other bits."""
    torch.manual_seed(0)
    attn = attention(_debug_args())
    x, grad = torch.randn(2, 64, 256), torch.randn(2, 64, 256)
    x_in = x.clone().requires_grad_()
    cos, sin = rope_tables(_debug_args(), 64)
    attn(x_in, cos, sin).backward(grad)
    assert torch.equal(x_in.grad, _input_grad(attn, x, grad, "qkv"))
    assert not torch.equal(x_in.grad, _input_grad(attn, x, grad, "kvq"))
