"""Preemption and non-finite steps: what every rank agrees on once per step.

Preemption (`signals.Preemption`): SIGTERM and SIGUSR1 (and in a command-line run the first Ctrl-C) only
set a flag. Once per step every rank contributes its flag (and whether its loss is finite) to one small
all-reduce, so all ranks agree on the same step to save a checkpoint and stop, whichever rank the signal
reached; one more such all-reduce before the first step (`stop_agreed`) stops a run that was signalled
while it started, before it trains anything.

How a rank ends under its launcher (following it in death, the failure report, exit codes) is
`rank_exit.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from titanlite.run.signals import Preemption


@dataclass
class StepVerdict:
    """What every rank agreed on after a step, read from the device once."""

    preempted: bool
    """Some rank received a stop signal."""
    finite: bool
    """Every rank's loss and the gradient norm are finite."""
    loss: float
    """The loss averaged over the data-parallel replicas (the value logged)."""
    grad_norm: float
    """The global gradient norm before clipping (the same on every rank)."""


def agree(preemption: Preemption, loss: torch.Tensor, grad_norm: torch.Tensor, device: torch.device) -> StepVerdict:
    """The step's one host sync: one all-reduce over the world and one read of its result.

    The tensor summed over the world holds [stop signal received, loss or grad norm not finite,
    loss / world size]; all of it is computed on the device (no read before the all-reduce). The last
    entry sums to the mean over the data-parallel replicas, since tensor-parallel peers hold the same
    loss. The grad norm (already global) is appended after the reduction, and the four numbers come to
    the host in one `tolist()`: the stop and skip decisions must be the same on every rank and taken
    before the update, so one read per step is needed, and the logged scalars ride along with it.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    loss = loss.detach().float().reshape(())
    grad_norm = grad_norm.detach().float().reshape(())
    flags = torch.stack(
        [
            torch.full((), float(preemption.received is not None), device=device),
            (~(torch.isfinite(loss) & torch.isfinite(grad_norm))).float(),
            loss / world,
        ]
    )
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.SUM)
    preempted, nonfinite, mean_loss, norm = torch.cat([flags, grad_norm.reshape(1)]).tolist()
    return StepVerdict(preempted=preempted > 0, finite=nonfinite == 0, loss=mean_loss, grad_norm=norm)


def stop_agreed(preemption: Preemption, device: torch.device) -> bool:
    """Whether any rank has received a stop signal (collective over the world): asked once before the
    first step, so a run signalled while it started stops without training."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return preemption.received is not None
    flag = torch.full((1,), float(preemption.received is not None), device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
