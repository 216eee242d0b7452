"""The step policy: gathered weights kept for a step of several backwards, and the reduction chosen by memory.

Collective counts come from one process on torch's fake process group (values are meaningless there; the
pattern is real), each model built by `build.build_training` as the trainer builds it and stepped by the
trainer's step runner (`step.LocalRunner`). Numerics of the kept path are checked against one process in
test_parallel_parity (accumulation and pipeline cases run it by default).
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from builders import config
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from harness import tiny_args
from titanlite.config import JobConfig
from titanlite.data.batch import Batch
from titanlite.parallelisms.data_parallel.gradient_reduction import step_candidates
from titanlite.parallelisms.step_context import StepContext
from titanlite.parallelisms.step_policy import StepPolicy
from titanlite.planning.memory import COMFORT_FRACTION, GiB, first_fitting
from titanlite.planning.run_plan import RunPlan
from titanlite.run.build import build_training
from titanlite.run.step import LocalRunner, cross_entropy_loss
from titanlite.run.trainer import Trainer

ARGS = tiny_args()
MICROBATCHES = 4


class CountCollectives(TorchDispatchMode):
    """Functional collectives (SimpleFSDP) and process-group ones (FSDP2), by kind."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0].strip("_").replace("allgather", "all_gather")
        if func.namespace in ("_c10d_functional", "c10d") and name.startswith(("all_gather", "reduce_scatter")):
            self.counts["all_gather" if name.startswith("all_gather") else "reduce_scatter"] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def step_config(
    dp_impl: str = "simple_fsdp", reshard: str = "auto", reduction: str = "auto", dump: str = "/nonexistent", **over
) -> JobConfig:
    """dp 2 x 4 accumulated microbatches of 8 tokens; nothing is written unless compiled (the compile
    report goes to `dump`)."""
    return config(
        dump,
        training__seq_len=8,
        training__local_batch_size=1,
        training__global_batch_size=2 * MICROBATCHES,
        parallelism__dp_impl=dp_impl,
        parallelism__fsdp_reshard_after_forward=reshard,
        parallelism__gradient_reduction=reduction,
        **over,
    )


def step_counts(cfg: JobConfig, steps: int = 1) -> tuple[StepPolicy, Counter, int]:
    """(the policy chosen, the collectives of `steps` accumulated steps, parameters). A compiled model's
    collectives are not counted: Dynamo refuses to trace under a dispatch mode."""
    plan = RunPlan.build(cfg, 2, args=ARGS)
    built = build_training(plan, torch.device("cpu"))
    policy = built.step_choice.policy
    batches = [Batch.of_windows(t) for t in torch.randint(0, ARGS.vocab_size, (MICROBATCHES, 1, 9))]
    opt = torch.optim.SGD(built.model.parameters(), lr=0.0)
    counter = CountCollectives()
    with contextlib.nullcontext() if cfg.compile.enable else counter:
        context = StepContext(cross_entropy_loss, reduce_once=policy.reduce_once, keep_gathers=policy.keep_gathers)
        for _ in range(steps):
            LocalRunner(built.model, torch.device("cpu"), context).forward_backward(opt, batches)
    return policy, counter.counts, len(list(built.model.parameters()))


@pytest.mark.parametrize("reduction", ["per_step", "per_microbatch"])
def test_simple_fsdp_gathers_each_weight_once_per_step_when_kept(fake_world, reduction):
    """4 accumulated microbatches: kept (auto, the memory fits), every parameter is gathered once per step;
    gathered again per microbatch (reshard `default`, the negative control) it is 4 forwards' gathers plus
    the backward's regathers of the blocks resharded after forward. The reductions are the policy's: per
    microbatch, a reduce-scatter per parameter per backward, also from the kept weights."""
    kept, counts, n = step_counts(step_config(reduction=reduction))
    again, again_counts, _ = step_counts(step_config(reshard="default", reduction=reduction))
    assert kept.keep_gathers and not again.keep_gathers
    assert counts["all_gather"] == n
    regathered = (ARGS.n_layers - 1) * 9  # every block but the last: 9 parameters each
    assert again_counts["all_gather"] == MICROBATCHES * (n + regathered)
    rs = MICROBATCHES * n if reduction == "per_microbatch" else 1  # per_step: the tiny model is one bucket
    assert counts["reduce_scatter"] == again_counts["reduce_scatter"] == rs


@pytest.mark.slow  # two compiled models (about 15 s)
def test_compiled_blocks_read_the_kept_weights_gathered_once_per_step(fake_world, tmp_path, monkeypatch):
    """Compiled blocks (aot_eager, transformer_block bucketing) under 4 accumulated microbatches, two steps:
    kept, each step gathers each parameter once, eagerly, and the graphs trace no gather (they read the
    kept weights as inputs); the second step reuses the graph. Gathered again per microbatch (reshard
    `default`, the negative control), the graphs gather, so every forward does. Gathers are counted
    where they are made: eagerly (run once per call) or while Dynamo traces (run by every call of the
    graph)."""
    from torch._dynamo.utils import counters

    from titanlite.parallelisms.data_parallel.replicate_compute import ReplicateComputation

    made: Counter[str] = Counter()
    gather_local = ReplicateComputation._gather_local

    def counted(self, x):
        made["traced" if torch.compiler.is_compiling() else "eager"] += 1
        return gather_local(self, x)

    monkeypatch.setattr(ReplicateComputation, "_gather_local", counted)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    compiled = {
        "compile__enable": True,
        "compile__backend": "aot_eager",
        "compile__bucketing": "transformer_block",
        "dump": str(tmp_path),
    }
    counters.clear()
    kept, _, n = step_counts(step_config(**compiled), steps=2)
    assert kept == StepPolicy(reduce_once=True, keep_gathers=True)
    assert made == {"eager": 2 * n}
    assert counters["stats"]["unique_graphs"] == 1  # one block graph, shared by the blocks and both steps
    made.clear()
    again, _, _ = step_counts(step_config(reshard="default", **compiled))
    assert not again.keep_gathers and made["traced"] > 0


def test_fsdp2_gathers_each_unit_once_per_step_when_kept(fake_world):
    """FSDP2 (one all-gather per block and one for the root): kept, reshard-after-forward and -backward are
    off until the last backward."""
    kept, counts, _ = step_counts(step_config("fsdp2"))
    again, again_counts, _ = step_counts(step_config("fsdp2", reshard="default"))
    units = ARGS.n_layers + 1
    assert kept.keep_gathers and counts["all_gather"] == units
    assert not again.keep_gathers and again_counts["all_gather"] == MICROBATCHES * (units + ARGS.n_layers - 1)


@pytest.mark.parametrize(
    "overrides,policies,why",
    [
        ({}, [(1, 1), (0, 1), (1, 0), (0, 0)], ""),
        ({"fsdp_reshard_after_forward": "default"}, [(1, 0), (0, 0)], "fsdp_reshard_after_forward = default"),
        ({"fsdp_reshard_after_forward": "never"}, [(1, 1), (0, 1)], "fsdp_reshard_after_forward = never"),
        ({"gradient_reduction": "per_microbatch"}, [(0, 1), (0, 0)], "gradient_reduction = per_microbatch"),
        (
            {"compile": True},
            [(1, 1), (1, 0), (0, 0)],
            "compiled SimpleFSDP keeps gathered weights only with the per_step reduction",
        ),
        (
            {"compile": True, "gradient_reduction": "per_microbatch", "fsdp_reshard_after_forward": "never"},
            [(0, 0)],
            "compiled SimpleFSDP keeps gathered weights only with the per_step reduction",
        ),
        ({"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 1}, [(1, 0), (0, 0)], ""),
    ],
)
def test_explicit_settings_are_honoured_and_auto_is_left_to_memory(overrides, policies, why):
    cfg = JobConfig()
    cfg.compile.enable = overrides.pop("compile", False)
    for key, value in overrides.items():
        setattr(cfg.parallelism, key, value)
    mode = "replicate" if cfg.parallelism.data_parallel_replicate_degree > 1 else "fully_shard"
    candidates, fixed = step_candidates(cfg, mode, backwards=4)
    assert [(c.reduce_once, c.keep_gathers) for c in candidates] == [tuple(map(bool, p)) for p in policies]
    assert (why in fixed) if why else not fixed
    assert step_candidates(cfg, mode, backwards=1)[0] == [StepPolicy()]  # one backward: nothing to hold


def test_the_first_policy_that_fits_in_the_margin_wins_else_the_one_that_holds_least():
    candidates = step_candidates(JobConfig(), "fully_shard", backwards=4)[0]
    capacity = 80 * GiB
    margin = int(COMFORT_FRACTION * capacity)
    chosen = first_fitting(candidates, [margin + 1, margin, 10 * GiB, 5 * GiB], capacity)
    assert chosen.policy == candidates[1]  # per_microbatch + kept: exactly at the margin
    assert "over 90%: per_step + kept 72.0 GiB" in chosen.describe()
    least = first_fitting(candidates, [90 * GiB, 85 * GiB, 81 * GiB, 82 * GiB], capacity)
    assert least.policy == candidates[2] and "none fits in 90%" in least.describe()


def test_the_trainers_plan_line_says_which_policy_and_why(process_group, tmp_path):
    cfg = step_config()
    cfg.job.dump_folder = str(tmp_path)
    cfg.training.global_batch_size = MICROBATCHES
    trainer = Trainer(cfg, RunPlan.build(cfg, 1, args=ARGS))
    try:
        line = trainer.plan.describe(trainer.step_choice)
    finally:
        trainer.close()
    assert trainer.reduce_once and trainer.keep_gathers
    assert "step of 4 backwards: gradient reduction per_step, weights kept for the step (auto, by the memory" in line
