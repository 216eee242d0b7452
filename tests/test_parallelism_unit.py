"""A parallelism is one unit (`parallelisms/parallelism.py`): what adding one touches.

A test-only parallelism, defined here and given its place in the order (`parallelize.PARALLELISMS`) and
nowhere else, plugs in through the seam: its rule refuses a bad config in the launcher's preflight, before
any rank starts; the model build runs its apply function; the step context applies its batch and loss
hook. And the real units' modules are imported, outside the model families' seams, only by the order and
the step code that uses a seam's type: nothing in the plan, the checkpoint, the trainer, validation, the
build, the planning or the tools names one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from builders import config
from torch import nn

from titanlite.errors import ConfigError
from titanlite.launcher.preflight import check_run
from titanlite.parallelisms import parallelize
from titanlite.parallelisms.data_parallel.gradient_reduction import StepPolicy
from titanlite.parallelisms.parallelism import ApplyArgs, ParallelismUnit
from titanlite.planning.memory import StepChoice
from titanlite.planning.run_plan import RunPlan
from titanlite.run import build

PACKAGE = Path(__file__).resolve().parents[1] / "titanlite"


@dataclass(frozen=True)
class HalfHook:
    """Keeps the first half of every sequence and doubles the loss."""

    def batch(self, t: torch.Tensor) -> torch.Tensor:
        return t[:, : t.shape[1] // 2]

    def loss(self, loss: torch.Tensor) -> torch.Tensor:
        return 2 * loss


@dataclass
class Toy:
    """A parallelism of degree 2 on every mesh, recording what it was applied to."""

    applied: list[nn.Module] = field(default_factory=list)

    def rules(self, cfg, dims, spec, args) -> None:
        if cfg.training.seq_len % 3:
            raise ConfigError(f"training.seq_len {cfg.training.seq_len} is not a multiple of the toy's 3")

    def apply(self, a: ApplyArgs) -> dict:
        self.applied.append(a.model)
        return {}

    def unit(self) -> ParallelismUnit:
        return ParallelismUnit("toy", lambda dims: 2, self.rules, self.apply, step_hook=lambda dims: HalfHook())


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


def _importers(module: str) -> set[str]:
    """Product files outside the model families that import `titanlite.parallelisms.<module>`."""
    pattern = re.compile(rf"parallelisms\.{module}\b|from titanlite\.parallelisms import [^\n]*\b{module}\b")
    return {
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if not path.is_relative_to(PACKAGE / "models") and pattern.search(path.read_text())
    }


FOOTPRINT = {
    "tensor": {"parallelisms/parallelize.py"},
    # The forward hands the model its positions (`SequenceShard`, the hook's type), in both step runners.
    "context": {"parallelisms/parallelize.py", "parallelisms/step_context.py", "run/step.py"},
    # The compiled blocks' graph break around the token dispatch.
    "expert": {"parallelisms/parallelize.py", "compile/compiler.py"},
}


def test_the_real_parallelisms_are_named_by_the_order_only():
    """Each unit of the order, and who imports its module beyond the model families' seams."""
    modules = {unit.name: unit.rules.__module__.split(".")[2] for unit in parallelize.PARALLELISMS}
    assert modules == {"tensor": "tensor_parallel", "context": "context_parallel", "expert": "expert_parallel"}
    for name, module in modules.items():
        assert _importers(module) == FOOTPRINT[name], name
