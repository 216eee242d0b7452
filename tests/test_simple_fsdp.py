"""SimpleFSDP structure on a fake process group (one process): which collectives run, and when.

Values on the fake group are meaningless; only the collective pattern is checked. Forward gathers every
parameter once; backward reduce-scatters every gradient once; reshard-after-forward makes backward
gather again exactly the weights that forward saved for backward, and `never` gathers nothing again.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from harness import tiny_args
from titanlite.build import RunPlan, build_model
from titanlite.config import JobConfig
from titanlite.models.llama3 import Transformer

ARGS = tiny_args()
PARAMS_PER_BLOCK = 9  # wq wk wv wo w1 w2 w3 + two norms


class CountCollectives(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and func.__name__.split(".")[0] != "wait_tensor":
            self.counts[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def build(reshard: str, mode_shard: int = 2, rep: int = 1) -> Transformer:
    cfg = JobConfig()
    cfg.training.mixed_precision_param = "float32"
    cfg.parallelism.fsdp_reshard_after_forward = reshard
    cfg.parallelism.data_parallel_replicate_degree, cfg.parallelism.data_parallel_shard_degree = rep, mode_shard
    cfg.training.seq_len = 8
    return build_model(RunPlan.build(cfg, 2, args=ARGS), torch.device("cpu"))


def count(model: Transformer) -> tuple[Counter, Counter]:
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    with CountCollectives() as fwd:
        loss = model(tokens).float().mean()
    with CountCollectives() as bwd:
        loss.backward()
    return fwd.counts, bwd.counts


def test_parameters_are_sharded_dtensors_and_state_dict_stays_sharded(fake_world):
    model = build("default")
    n_params = len(list(model.parameters()))
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),), name
        assert p.to_local().shape[0] == (p.shape[0] + 1) // 2, name  # rank 0 holds the larger half
    sd = model.state_dict()
    assert len(sd) == n_params and all(isinstance(v, DTensor) for v in sd.values())
    # The attribute goes through the gather: a full plain tensor.
    w = model.layers["0"].attention.wq.weight
    assert not isinstance(w, DTensor) and w.shape == (ARGS.dim, ARGS.dim)


@pytest.mark.parametrize("reshard,regathered_blocks", [("never", 0), ("default", 2), ("always", 3)])
def test_reshard_after_forward_regathers_in_backward(fake_world, reshard, regathered_blocks):
    model = build(reshard)
    n_params = len(list(model.parameters()))
    fwd, bwd = count(model)
    assert fwd["all_gather_into_tensor"] == n_params
    assert bwd["reduce_scatter_tensor"] == n_params
    extra = 0
    if reshard == "always":
        extra = 2  # final norm and output weight (the embedding weight is not saved for backward)
    assert bwd["all_gather_into_tensor"] == regathered_blocks * PARAMS_PER_BLOCK + extra


def test_replicate_mode_all_reduces_gradients(fake_world):
    model = build("default", mode_shard=1, rep=2)
    fwd, bwd = count(model)
    n_params = len(list(model.parameters()))
    assert fwd["all_gather_into_tensor"] == 0 and bwd["reduce_scatter_tensor"] == 0
    assert bwd["all_reduce"] == n_params


def test_state_dict_apis_do_not_gather_under_sharded_view(fake_world):
    """torch's get_state_dict names parameters by attribute access; the sharded view keeps it collective-free."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from titanlite.parallelisms.simple_fsdp import sharded_view

    model = build("default")
    with CountCollectives() as plain:
        get_model_state_dict(model)
    with CountCollectives() as viewed, sharded_view():
        sd = get_model_state_dict(model)
    assert plain.counts["all_gather_into_tensor"] > 0  # what the view avoids
    assert sum(viewed.counts.values()) == 0
    assert all(isinstance(v, DTensor) for v in sd.values())
