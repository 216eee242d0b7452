"""Preemption, non-finite steps and fault injection.

Preemption: SIGTERM and SIGUSR1 only set a flag. Once per step every rank contributes its flag (and
whether its loss is finite) to one small all-reduce, so all ranks agree on the same step to save a
checkpoint and stop, whichever rank the scheduler signalled.

Fault injection is for tests: environment variables that make a run fail in a chosen way at a chosen
step (`TITANLITE_FAULT_*`). A fault with `TITANLITE_FAULT_ONCE=<file>` fires only if that file does not
exist yet (it is created first), so a restarted run goes on normally.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger("titanlite")


class Preemption:
    """Records SIGTERM/SIGUSR1 instead of dying, so the trainer can checkpoint at a step boundary."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.received: int | None = None
        for sig in self.SIGNALS:
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        self.received = signum


@dataclass
class StepVerdict:
    preempted: bool
    finite: bool


def agree(preemption: Preemption, loss: torch.Tensor, grad_norm: torch.Tensor, device: torch.device) -> StepVerdict:
    """One all-reduce over the world: did any rank get a stop signal, and is every loss/grad norm finite?"""
    flags = torch.tensor(
        [
            float(preemption.received is not None),
            float(not (torch.isfinite(loss).item() and torch.isfinite(grad_norm).item())),
        ],
        device=device,
    )
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return StepVerdict(preempted=bool(flags[0].item()), finite=not bool(flags[1].item()))


# --- test-only fault injection ---------------------------------------------------------------------------


def _fault_step(name: str) -> int | None:
    value = os.environ.get(f"TITANLITE_FAULT_{name}")
    return int(value) if value else None


def _claim_once() -> bool:
    """True if this fault may fire: no TITANLITE_FAULT_ONCE file, or we are the first to create it."""
    path = os.environ.get("TITANLITE_FAULT_ONCE")
    if not path:
        return True
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def inject_before_step(step: int, rank: int) -> None:
    """`TITANLITE_FAULT_EXIT_AT=k` (with `TITANLITE_FAULT_RANK`, default 0): that rank dies at step k;
    `TITANLITE_FAULT_SIGTERM_AT=k`: that rank sends itself SIGTERM at step k."""
    if rank != int(os.environ.get("TITANLITE_FAULT_RANK", "0")):
        return
    if step == _fault_step("EXIT_AT") and _claim_once():
        logger.error(f"fault injection: rank {rank} exits abruptly at step {step}")
        os._exit(17)
    if step == _fault_step("SIGTERM_AT") and _claim_once():
        os.kill(os.getpid(), signal.SIGTERM)


def nan_injection(step: int) -> bool:
    """`TITANLITE_FAULT_NAN_AT=k[,k2...]`: the loss of those steps is made NaN (every rank)."""
    value = os.environ.get("TITANLITE_FAULT_NAN_AT")
    return bool(value) and str(step) in value.split(",")
