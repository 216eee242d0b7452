"""A parallelism is one unit (`parallelisms/parallelism.py`): what adding one touches.

A test-only parallelism, defined here and given its place in the order (`parallelize.PARALLELISMS`) and
nowhere else, plugs in through the seam: its rule refuses a bad config in the launcher's preflight, before
any rank starts; the model build runs its apply function; the step context applies its batch and loss
hook. And every parallelism is a folder and a unit of the order: its folder is imported, outside the model
families' seams, by the order and the few named in `FOOTPRINT` only; the step, the plan and the build
reach it through the order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from builders import config
from torch import nn

from titanlite.checkpoint.weights import sharded
from titanlite.errors import ConfigError
from titanlite.launcher.preflight import check_run
from titanlite.parallelisms import parallelize
from titanlite.parallelisms.parallelism import ApplyArgs, ParallelismUnit, StepHook, StepPolicies
from titanlite.parallelisms.step_policy import StepPolicy
from titanlite.planning.memory import StepChoice
from titanlite.planning.run_plan import RunPlan
from titanlite.run import build

PACKAGE = Path(__file__).resolve().parents[3] / "titanlite"


@dataclass(frozen=True)
class HalfHook(StepHook):
    """Keeps the first half of every sequence and doubles the loss."""

    def batch(self, t: torch.Tensor) -> torch.Tensor:
        return t[:, : t.shape[1] // 2]

    def loss(self, loss: torch.Tensor) -> torch.Tensor:
        return 2 * loss


@dataclass
class Toy:
    """A parallelism every run has, recording what it was applied to."""

    applied: list[nn.Module] = field(default_factory=list)

    def rules(self, cfg, dims, spec, args) -> None:
        if cfg.training.seq_len % 3:
            raise ConfigError(f"training.seq_len {cfg.training.seq_len} is not a multiple of the toy's 3")

    def apply(self, a: ApplyArgs) -> dict:
        self.applied.append(a.model)
        return {}

    def unit(self) -> ParallelismUnit:
        return ParallelismUnit("toy", lambda cfg, dims: True, self.rules, self.apply, step_hook=lambda dims: HalfHook())


@pytest.fixture
def toy(monkeypatch) -> Toy:
    """The toy unit at the end of the order: the one place adding a parallelism touches besides its module
    and its setting."""
    toy = Toy()
    monkeypatch.setattr(parallelize, "PARALLELISMS", (*parallelize.PARALLELISMS, toy.unit()))
    return toy


def test_a_parallelism_plugs_in_through_its_unit(toy, process_group, tmp_path):
    """Rule, apply and step hook of a parallelism that only the order names."""
    with pytest.raises(ConfigError) as refused:
        check_run(config(tmp_path, training__seq_len=16), 1)  # the launcher's preflight, before any rank
    assert str(refused.value) == "training.seq_len 16 is not a multiple of the toy's 3"

    plan = RunPlan.build(config(tmp_path, training__seq_len=15), 1)
    model = build.build_model(plan, torch.device("cpu"))
    assert toy.applied == [model]  # the framework's order applied it, once, to the model it built

    ctx = build.step_context(plan, StepChoice(StepPolicy(), (StepPolicy(),), (0,), 1))
    tokens = torch.arange(2 * 15).view(2, 15)
    assert torch.equal(ctx.shard(tokens), tokens[:, :7])
    pred, labels = torch.randn(2, 7, plan.model_args.vocab_size), torch.randint(0, 100, (2, 7))
    assert torch.equal(ctx.microbatch_loss(pred, labels, backwards=4), 2 * ctx.loss_fn(pred, labels) / 4)


def test_the_step_policies_come_from_a_unit(monkeypatch, process_group, tmp_path):
    """The plan's step candidates and the build's chosen policy come from the unit that holds state across
    a step's backwards (data parallelism's, here replaced by a recording one), through the order."""
    chosen = StepPolicy(reduce_once=True, keep_gathers=True)
    applied: list[tuple[nn.Module, StepPolicy]] = []
    held = StepPolicies(lambda cfg, dims, backwards: ([chosen], ["the toy's"]), lambda m, p: applied.append((m, p)))
    order = tuple(
        dataclasses.replace(u, step_policies=held) if u.step_policies is not None else u
        for u in parallelize.PARALLELISMS
    )
    monkeypatch.setattr(parallelize, "PARALLELISMS", order)
    plan = RunPlan.build(config(tmp_path), 1)
    assert (plan.step_candidates, plan.step_fixed) == ([chosen], ["the toy's"])
    training = build.build_training(plan, torch.device("cpu"))
    assert training.step_choice.policy == chosen and applied == [(training.model, chosen)]


def test_the_device_rules_and_the_stored_view_come_from_the_units(monkeypatch, tmp_path):
    """The launcher's check of the ranks' device and a checkpoint's view of the weights as stored reach a
    unit through the order: a toy that refuses every device and records the models viewed."""
    viewed: list[nn.Module] = []

    @contextlib.contextmanager
    def stored(model: nn.Module) -> Iterator[None]:
        viewed.append(model)
        yield

    def no_device(cfg, device: torch.device) -> None:
        raise ConfigError(f"the toy runs on no {device.type}")

    toy = ParallelismUnit("toy", lambda cfg, dims: True, lambda *a: None, lambda a: {})
    toy = dataclasses.replace(toy, check_device=no_device, sharded_view=stored)
    monkeypatch.setattr(parallelize, "PARALLELISMS", (*parallelize.PARALLELISMS, toy))
    with pytest.raises(ConfigError, match="^the toy runs on no (cpu|cuda)$"):
        check_run(config(tmp_path), 1)
    model = nn.Linear(2, 3)
    assert sharded(lambda m: m.weight.shape, model) == (3, 2) and viewed == [model]


def _importers(folder: str, package: Path = PACKAGE) -> set[str]:
    """Product files outside the model families and outside `folder` that import
    `titanlite.parallelisms.<folder>`."""
    pattern = re.compile(rf"parallelisms\.{folder}\b|from titanlite\.parallelisms import [^\n]*\b{folder}\b")
    return {
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if not path.is_relative_to(package / "models")
        and not path.is_relative_to(package / "parallelisms" / folder)
        and pattern.search(path.read_text())
    }


ORDER = "parallelisms/parallelize.py"
SECTION = "parallelisms/config.py"
"""The `parallelism` section, the union of the units' keys (each unit's `config.py`)."""
FOOTPRINT = {
    "float8": {
        ORDER,
        # The schema's list of sections composes its section (`float8/config.py`), which the config exports.
        "config/schema.py",
        "config/__init__.py",
        # The memory estimates count the weights gathered in float8 (`converted_weights`).
        "planning/memory.py",
        "planning/param_shapes.py",
    },
    "tensor_parallel": {ORDER, SECTION},
    "context_parallel": {ORDER, SECTION},
    "expert_parallel": {
        ORDER,
        SECTION,
        # The layout search's parameter shapes mark the routed experts' weights (`expert_modules`), which expert
        # parallelism splits before data parallelism gathers the rest.
        "planning/param_shapes.py",
    },
    "pipeline": {
        ORDER,
        SECTION,
        # The config exports the schedules that split the weight backward (`SPLIT_BACKWARD_SCHEDULES`), under
        # which SimpleFSDP's gradient reduction runs per microbatch.
        "config/__init__.py",
        # The layout space enumerates the schedules (`SINGLE_STAGE`, `MULTI_STAGE`).
        "planning/layout_space.py",
    },
    "data_parallel": {
        ORDER,
        SECTION,
        # The experts' own mesh is a data-parallel placement (`DataParallelMesh`).
        "parallelisms/expert_parallel/unit.py",
        # Float8's gathers are SimpleFSDP's with a float8 wire (`ReplicateComputation.wire`).
        "parallelisms/float8/gather.py",
        # The step's gradient reduction and kept gathers (`reduce_once`), run by the step context.
        "parallelisms/step_context.py",
        # The reshard policy and the unreduced gradients' bucket the memory estimate counts (`REDUCE_BUCKET_BYTES`).
        "planning/memory.py",
        # The dry run's re-gathers under the prefetcher follow the reshard policy the memory estimate counts.
        "tools/dry_run.py",
        # SimpleFSDP's states, gathers and reshard policy, which the compiler's passes bucket and its prefetch installs.
        "compile/compiler.py",
        "compile/phase.py",
        "compile/prefetch.py",
    },
}
"""Who imports each parallelism's folder beyond the model families' seams: the order, and the few named."""
UNNAMED = ("run/step.py", "planning/run_plan.py", "run/build.py")
"""The step, the plan and the build name no parallelism but through the order."""


def test_the_real_parallelisms_are_named_by_the_order_only():
    """Each unit of the order, and who imports its folder beyond the model families' seams."""
    folders = {unit.name: unit.apply.__module__.split(".")[2] for unit in parallelize.PARALLELISMS}
    assert folders == {
        "float8": "float8",
        "tensor": "tensor_parallel",
        "context": "context_parallel",
        "expert": "expert_parallel",
        "pipeline": "pipeline",
        "data": "data_parallel",
    }
    for folder in folders.values():
        assert _importers(folder) == FOOTPRINT[folder], folder
        assert not _importers(folder) & set(UNNAMED), folder


def test_the_footprint_sees_an_import(tmp_path):
    """Negative control: an import of a unit's folder from the step is seen, in either spelling; the model
    families' and the folder's own are not."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "step.py").write_text("from titanlite.parallelisms.float8.gather import float8_gathers_of\n")
    (tmp_path / "run" / "build.py").write_text("from titanlite.parallelisms import pipeline\n")
    for own in ("models/llama3", "parallelisms/float8"):
        (tmp_path / own).mkdir(parents=True)
        (tmp_path / own / "x.py").write_text("from titanlite.parallelisms.float8 import unit\n")
    assert _importers("float8", tmp_path) == {"run/step.py"}
    assert _importers("pipeline", tmp_path) == {"run/build.py"}
