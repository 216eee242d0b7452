"""What a replica group hands a peer behind it and applies when it is the one behind (`run/replica_state.py`):
a group of the same identity takes the state whole; one of another model, layout or batch refuses it,
naming the first difference, before any parameter changes."""

from __future__ import annotations

import pytest
import torch
from builders import config
from torch import nn

from harness import tiny_args
from titanlite.checkpoint.training_state import TrainingState
from titanlite.errors import ConfigError
from titanlite.planning.run_plan import RunPlan
from titanlite.run.optimizer import build_lr_scheduler, build_optimizer
from titanlite.run.replica_state import ReplicaState

STEP = 7


def plan(world: int = 1, n_layers: int = 2) -> RunPlan:
    cfg = config(None, training__seq_len=16, training__local_batch_size=2, training__steps=20)
    return RunPlan.build(cfg, world, args=tiny_args(n_layers=n_layers))


def replica(p: RunPlan, seed: int, trained: bool = False) -> tuple[ReplicaState, nn.Module, torch.optim.Optimizer]:
    """A rank's state over a small stand-in model (the identity is the plan's), `trained` one AdamW step."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    optimizer = build_optimizer(model, p.cfg.optimizer)
    schedule = build_lr_scheduler(optimizer, p.cfg.lr_scheduler, p.cfg.training.steps)
    if trained:
        model(torch.randn(4, 6)).square().sum().backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    state = TrainingState(model, optimizer, schedule, None, rank=0, dp_rank=0, dp_degree=1, device=torch.device("cpu"))
    return ReplicaState(state, None, p, lambda: STEP), model, optimizer


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_a_group_of_the_same_identity_takes_the_state_whole():
    sender, sent_model, sent_optimizer = replica(plan(), seed=0, trained=True)
    receiver, model, optimizer = replica(plan(), seed=1)
    assert not all(torch.equal(a, b) for a, b in zip(params(model), params(sent_model)))  # the control
    assert receiver.restore(sender.capture()) == STEP
    assert all(torch.equal(a, b) for a, b in zip(params(model), params(sent_model)))
    ours, theirs = optimizer.state_dict()["state"], sent_optimizer.state_dict()["state"]
    assert ours.keys() == theirs.keys() and len(ours) == 4
    assert all(torch.equal(ours[k]["exp_avg_sq"], theirs[k]["exp_avg_sq"]) for k in ours)


@pytest.mark.parametrize(
    "other,first_difference",
    [
        (
            dict(n_layers=4),
            ["the live group's model is llama3 debugmodel (n_layers 2,", "this group's llama3 debugmodel (n_layers 4,"],
        ),
        # Another mesh changes the global batch too: the layout, the first key, is named.
        (dict(world=2), ["the live group's layout is mesh {'dp_shard': 1}", "this group's mesh {'dp_shard': 2}"]),
    ],
)
def test_another_identity_is_refused_naming_the_first_difference_before_anything_changes(other, first_difference):
    sender, _, _ = replica(plan(), seed=0, trained=True)
    receiver, model, optimizer = replica(plan(**other), seed=1)
    before, schedule = params(model), receiver.state.lr_scheduler.state_dict()
    with pytest.raises(ConfigError) as refused:
        receiver.restore(sender.capture())
    message = str(refused.value)
    assert "\n" not in message and all(part in message for part in first_difference), message
    assert message.count("the live group's") == 1
    assert all(torch.equal(a, b) for a, b in zip(params(model), before))
    assert not optimizer.state and receiver.state.lr_scheduler.state_dict() == schedule
