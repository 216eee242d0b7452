"""The LR schedule on resume: the saved position, this run's hyperparameters.

Protocol: a checkpoint holds the scheduler's `state_dict` (its step, `last_epoch`) and the optimizer's
param groups (lr, betas, eps, weight decay, ...). A resume keeps the position and takes every
hyperparameter from this run's config: the param groups as the config built them are read before the
optimizer state is loaded (`config_groups`) and put back after it (`restore_schedule`), and the current
LR is recomputed at the restored step as the scheduler's own step computes it, so an unchanged config
restores it bitwise and a changed one (a new peak LR, say) applies from the resumed step on.
"""

from __future__ import annotations

import torch


def config_groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The optimizer's param groups without their parameters: this run's hyperparameters, read before a
    checkpoint's optimizer state replaces them."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def restore_schedule(lr_scheduler, optimizer: torch.optim.Optimizer, saved: dict, fresh: list[dict]) -> None:
    """Load the schedule's position `saved` with this run's hyperparameters `fresh` (`config_groups`).

    `set_state_dict` put the saved param groups back and the saved schedule holds the old base LR: both
    are replaced by `fresh`, and the current LR is recomputed at the restored step.
    """
    base = [group["initial_lr"] for group in fresh]
    lrs = [b * fn(saved["last_epoch"]) for b, fn in zip(base, lr_scheduler.lr_lambdas)]
    lr_scheduler.load_state_dict({**saved, "base_lrs": base, "_last_lr": lrs})
    for group, new, lr in zip(optimizer.param_groups, fresh, lrs):
        group.update(new, lr=lr)
