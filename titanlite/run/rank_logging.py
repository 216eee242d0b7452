"""A rank's log: one stderr handler on the `titanlite` logger, and torch's advice a user cannot act on left out.

The trainer calls `init_logging` once it knows its rank; nothing here runs at import. Under the launcher,
which starts each line with `[rank<r>]: `, a line does not name its rank a second time; alone or under
torchrun it starts with `[titanlite rank<r>]`. Records still propagate, so handlers on the root logger
(pytest's, a notebook's) see them too. torch's own loggers are left alone but for one record
(`drop_unactionable_torch_advice`).
"""

from __future__ import annotations

import logging
import os

from titanlite.run.rank_exit import LAUNCHER_PID_ENV

logger = logging.getLogger("titanlite")

REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"


class _UnactionableTorchAdvice(logging.Filter):
    """Drops DTensor's advice that a redistribution runs one collective per mesh dim ("While
    redistributing from ... sequential ... operations"), which torch logs once per mesh for the gradient
    norm of a tensor-parallel run (a `_NormPartial` reduced over dp and tp): the user can do nothing about
    it, and its "may give inconsistent results between ranks" reads like a fault. Every other record of
    that logger passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("While redistributing from")


def drop_unactionable_torch_advice() -> None:
    """Puts `_UnactionableTorchAdvice` on DTensor's redistribution logger, once per process."""
    torch_logger = logging.getLogger(REDISTRIBUTE_LOGGER)
    if not any(isinstance(f, _UnactionableTorchAdvice) for f in torch_logger.filters):
        torch_logger.addFilter(_UnactionableTorchAdvice())


def init_logging(rank: int) -> None:
    """One stderr handler on the `titanlite` logger (replaced, not added, when a process builds several
    trainers), at INFO, then `drop_unactionable_torch_advice`."""
    for handler in [h for h in logger.handlers if getattr(h, "titanlite", False)]:
        logger.removeHandler(handler)
    handler = logging.StreamHandler()
    prefix = "" if os.environ.get(LAUNCHER_PID_ENV) else f"[titanlite rank{rank}] "
    handler.setFormatter(logging.Formatter(f"{prefix}%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S"))
    handler.titanlite = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    drop_unactionable_torch_advice()
