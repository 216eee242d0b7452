"""LR schedule shapes and gradient clipping."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from titanlite.run.optimizer import clip_grad_norm_, lr_factor


def curve(**kw):
    base = dict(total_steps=100, warmup_steps=10, decay_ratio=1.0, decay_type="linear", min_lr_factor=0.0)
    base.update(kw)
    return [lr_factor(s, **base) for s in range(100)]


def test_warmup_is_linear_and_reaches_one():
    c = curve()
    assert c[0] == pytest.approx(1 / 11) and c[9] == pytest.approx(10 / 11)
    assert all(b > a for a, b in zip(c[:10], c[1:11]))


@pytest.mark.parametrize("kind", ["linear", "cosine", "sqrt"])
def test_decay_to_min(kind):
    c = curve(decay_type=kind, min_lr_factor=0.1)
    assert max(c) == pytest.approx(1.0)
    assert all(b <= a + 1e-12 for a, b in zip(c[10:], c[11:]))
    assert c[-1] == pytest.approx(
        0.1
        + 0.9
        * {"linear": 1 / 90, "cosine": 0.5 * (1 + math.cos(math.pi * 89 / 90)), "sqrt": 1 - math.sqrt(89 / 90)}[kind]
    )


def test_wsd_has_a_stable_phase():
    c = curve(decay_ratio=0.2)
    assert all(v == 1.0 for v in c[10:83]) and c[83] < 1.0  # 18 decay steps from step 82


def test_clip_grad_norm_matches_torch():
    ps = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    for p in ps:
        p.grad = torch.randn_like(p)
    expected = torch.sqrt(sum((p.grad**2).sum() for p in ps))
    norm = clip_grad_norm_(ps, 1.0)
    assert torch.allclose(norm, expected)
    assert torch.allclose(torch.sqrt(sum((p.grad**2).sum() for p in ps)), torch.tensor(1.0), atol=1e-5)


def test_the_gradient_norm_on_cpu_is_the_float64_norm_rounded_once():
    """A large gradient's norm (an embedding's 2,256 x 256) equals its float64 norm rounded to float32
    (relative 1e-7), independent of how it is split into tensors (one tensor or two halves, as two shards
    would hold it); torch's float32 norm of the same gradient (the negative control) drifts by more."""
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(2256, 256, generator=g) * torch.rand(2256, 1, generator=g) * 1e-3
    exact = torch.linalg.vector_norm(grad.double()).item()
    whole, halves = [torch.nn.Parameter(torch.empty_like(grad))], [torch.nn.Parameter(t) for t in grad.chunk(2)]
    whole[0].grad = grad.clone()
    for p, part in zip(halves, grad.chunk(2)):
        p.grad = part.clone()
    for params in (whole, halves):
        assert abs(clip_grad_norm_(params, 0.0).item() - exact) / exact < 1e-7
    fp32 = torch.nn.utils.get_total_norm([grad]).item()
    assert abs(fp32 - exact) / exact > 1e-6


def test_the_norm_of_sharded_gradients_is_the_norm_of_the_plain_ones(process_group):
    """DTensor gradients (sharded over a one-rank data-parallel mesh, as the trainer's are) give the same
    norm, bit for bit, as the same gradients as plain tensors, and are clipped to `max_norm`. Every
    supported torch must propagate the norm's sharding (torch 2.15's rule for `_foreach_norm` fails on
    a `dtype` argument)."""
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=g) * 1e-2 for shape in ((2256, 256), (256, 768), (256,))]
    plain = [torch.nn.Parameter(torch.empty_like(t)) for t in grads]
    sharded = [torch.nn.Parameter(distribute_tensor(torch.empty_like(t), mesh, [Shard(0)])) for t in grads]
    for p, s, t in zip(plain, sharded, grads):
        p.grad, s.grad = t.clone(), distribute_tensor(t.clone(), mesh, [Shard(0)])
    expected = clip_grad_norm_(plain, 0.0)
    norm = clip_grad_norm_(sharded, 1.0)
    assert not isinstance(norm, DTensor) and torch.equal(norm, expected)
    clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(s.grad.full_tensor()) for s in sharded]))
    assert expected.item() > 2 and clipped.item() == pytest.approx(1.0, rel=1e-5)
