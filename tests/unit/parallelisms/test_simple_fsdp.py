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
from builders import config
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from harness import tiny_args
from titanlite.config import JobConfig
from titanlite.data.batch import Batch
from titanlite.models.llama3 import Transformer
from titanlite.planning.run_plan import RunPlan
from titanlite.run.build import build_model

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


def build(reshard: str, mode_shard: int = 2, rep: int = 1, reduce_dtype: str = "float32") -> Transformer:
    cfg = config(
        training__mixed_precision_reduce=reduce_dtype,
        training__seq_len=8,
        parallelism__fsdp_reshard_after_forward=reshard,
        parallelism__data_parallel_replicate_degree=rep,
        parallelism__data_parallel_shard_degree=mode_shard,
    )
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

    from titanlite.parallelisms.data_parallel.simple_fsdp import sharded_view

    model = build("default")
    with CountCollectives() as plain:
        get_model_state_dict(model)
    with CountCollectives() as viewed, sharded_view(model):
        sd = get_model_state_dict(model)
    assert plain.counts["all_gather_into_tensor"] > 0  # what the view avoids
    assert sum(viewed.counts.values()) == 0
    assert all(isinstance(v, DTensor) for v in sd.values())


def test_sharded_view_is_scoped_to_the_model_it_wraps(fake_world):
    """Each wrapped model owns its SimpleFSDP state: viewing one model's shards leaves another gathering."""
    from titanlite.parallelisms.data_parallel.simple_fsdp import sharded_view, simple_fsdp_states

    a, b = build("default"), build("default")
    assert len(simple_fsdp_states([a, b])) == 2
    with sharded_view(a):
        assert isinstance(a.output.weight, DTensor)
        assert not isinstance(b.output.weight, DTensor)  # gathered to a plain tensor
    assert not isinstance(a.output.weight, DTensor)


# --- gradient accumulation: reductions per step -------------------------------------------------------


class CountAllCollectives(CountCollectives):
    """Also FSDP2's: it calls the process group's ops (`c10d`) rather than functional collectives."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and not func.__name__.startswith(("barrier", "monitored")):
            self.counts[func.__name__.split(".")[0].strip("_")] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def accumulated_step(model: torch.nn.Module, per_step: bool, microbatches: int = 4) -> Counter:
    """Collectives of the trainer's step runner over `microbatches` accumulated microbatches."""
    from titanlite.parallelisms.step_context import StepContext
    from titanlite.run.step import LocalRunner, cross_entropy_loss

    batches = [Batch.of_windows(t) for t in torch.randint(0, ARGS.vocab_size, (microbatches, 1, 9))]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with CountAllCollectives() as c:
        runner = LocalRunner(model, torch.device("cpu"), StepContext(cross_entropy_loss, reduce_once=per_step))
        runner.forward_backward(opt, batches)
    return c.counts


def reductions(counts: Counter, kind: str) -> int:
    """Functional (`reduce_scatter_tensor`, `all_reduce`) and process-group (`reduce_scatter_base`,
    `allreduce`) reductions of one kind."""
    return sum(n for name, n in counts.items() if name.replace("_", "").startswith(kind.replace("_", "")))


@pytest.mark.parametrize("rep,shard", [(1, 2), (2, 1)], ids=["fully_shard", "replicate"])
@pytest.mark.parametrize("bucket_bytes", [None, 1], ids=["one_bucket", "bucket_per_parameter"])
def test_accumulation_reduces_once_per_step(fake_world, monkeypatch, rep, shard, bucket_bytes):
    """4 microbatches: per_microbatch reduces every gradient in every backward (4 per parameter); per_step
    reduces once, in buckets (the tiny model's gradients fill one; with 1-byte buckets, one per
    parameter); the forward's gathers are the same."""
    from titanlite.parallelisms.data_parallel import step_reduction

    if bucket_bytes is not None:
        monkeypatch.setattr(step_reduction, "REDUCE_BUCKET_BYTES", bucket_bytes)
    counts = {}
    for per_step in (False, True):
        model = build("never", mode_shard=shard, rep=rep)
        counts[per_step] = accumulated_step(model, per_step)
        n = len(list(model.parameters()))
        assert all(isinstance(p.grad, DTensor) and p.grad.placements == p.placements for p in model.parameters())
        assert all(p.grad.to_local().shape == p.to_local().shape for p in model.parameters())
    kind = "reduce_scatter" if shard == 2 else "all_reduce"
    assert reductions(counts[False], kind) == 4 * n
    assert reductions(counts[True], kind) == (n if bucket_bytes else 1)
    gathers = reductions(counts[False], "all_gather")
    assert reductions(counts[True], "all_gather") == gathers == 4 * n * (shard == 2)


def test_fsdp2_accumulation_reduces_once_per_step(fake_world):
    """FSDP2 (one reduce-scatter per block and one for the root): the same 4 -> 1 under per_step."""
    counts = {}
    for per_step in (False, True):
        cfg = JobConfig()
        cfg.training.mixed_precision_param = "float32"
        cfg.training.seq_len = 8
        cfg.parallelism.dp_impl = "fsdp2"
        cfg.parallelism.fsdp_reshard_after_forward = "never"
        cfg.parallelism.data_parallel_shard_degree = 2
        model = build_model(RunPlan.build(cfg, 2, args=ARGS), torch.device("cpu"))
        counts[per_step] = accumulated_step(model, per_step)
    groups = ARGS.n_layers + 1
    assert reductions(counts[False], "reduce_scatter") == 4 * groups
    assert reductions(counts[True], "reduce_scatter") == groups


class RecordReductions(TorchDispatchMode):
    """The process-group reductions (`c10d` ops) dispatched, with the dtype they carry."""

    def __init__(self):
        super().__init__()
        self.dtypes: list[torch.dtype] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and "reduce" in func.__name__:
            self.dtypes.append(args[1].dtype if "scatter" in func.__name__ else args[0][0].dtype)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("last", ["marked", "counted", "unknown"])
def test_step_reduction_starts_buckets_in_the_last_backward(fake_world, monkeypatch, last):
    """Two accumulated backwards, one bucket per parameter. When the caller marks the last backward
    (`before_backward(True)`, the trainer's step) or gives the count (`backwards=2`, a pipeline), that
    backward starts every bucket's reduce-scatter itself, asynchronously, while it runs; otherwise they
    all start on leaving. The sinks sum in fp32 while the wire carries the bf16 reduce dtype, and each
    parameter gets its sharded gradient in the parameter's dtype."""
    from titanlite.parallelisms.data_parallel import step_reduction

    monkeypatch.setattr(step_reduction, "REDUCE_BUCKET_BYTES", 1)
    model = build("never", reduce_dtype="bfloat16")
    params = list(model.parameters())
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    in_backward = []
    with RecordReductions() as everything, step_reduction.unreduced(model, 2 if last == "counted" else 0) as mark:
        for i in range(2):
            loss = model(tokens).float().mean()
            if last == "marked":
                mark(i == 1)
            with RecordReductions() as during:
                loss.backward()
            in_backward.append(len(during.dtypes))
        sinks = [m.sink for m in model.modules() if getattr(m, "sink", None) is not None]
        assert len(sinks) == len(params) and all(s.dtype == torch.float32 for s in sinks)
    n = len(params)
    assert in_backward == ([0, n] if last != "unknown" else [0, 0])
    assert len(everything.dtypes) == n  # the rest started on leaving
    assert set(everything.dtypes) == {torch.bfloat16}
    for p in params:
        assert isinstance(p.grad, DTensor) and p.grad.dtype == torch.float32
        assert p.grad.placements == p.placements and p.grad.to_local().shape == p.to_local().shape
