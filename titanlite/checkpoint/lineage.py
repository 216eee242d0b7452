"""Which checkpoints belong to the line of training a run continues, and what happens to the others.

The checkpoints in `<dump_folder>/<checkpoint.folder>/` are one line of training, and a run resumes its newest
step. A run that resumes from an older step N (`checkpoint.load_step N`, or newer folders damaged or
model-only) starts a new line: once every rank has loaded N, rank 0 moves the newer folders, one `os.rename`
each, into `<checkpoint.folder>/abandoned-<UTC time>-from-step-N/` and logs one line naming them. Nothing is
deleted, and no resume or pruning sees them; left in place, the run would overwrite them, pruning would count
them as newest and a later plain launch would resume the old line. A torch elastic restart of the same
launch resumes the newest step it wrote itself (its marker's `launch` is this launch's
`TORCHELASTIC_RUN_ID`), not N again. The rule for users: docs/checkpoints.md#lines-of-training.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from titanlite.checkpoint import folders

logger = logging.getLogger("titanlite")

ABANDONED = "abandoned-"
"""Prefix of the folders a new line's start moves the old line's newer checkpoints into."""


def launch_id() -> str | None:
    """The launch that writes a checkpoint, as its marker records it: torch elastic's run id (one per
    launch, kept across its restarts), or None outside torch elastic."""
    return os.environ.get("TORCHELASTIC_RUN_ID")


def restarted() -> bool:
    """Whether this process belongs to a restarted attempt of its launch (torch elastic counts them)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def load_step(root: Path, asked: int) -> int:
    """The step a run loads: `asked` (`checkpoint.load_step`, -1 = the newest), except in a restarted
    attempt of a launch that has saved steps after `asked`, which resumes the newest (module docstring)."""
    if asked < 0 or not restarted() or (launch := launch_id()) is None:
        return asked
    for step in reversed(folders.scan(root)[0]):
        if step <= asked:
            break
        try:
            if folders.read_marker(folders.step_dir(root, step)).get("launch") == launch:
                return -1
        except (OSError, ValueError):
            continue  # no or no readable marker: not this launch's
    return asked


def set_aside(root: Path, resumed: int) -> str | None:
    """Move every `step-M` folder with M > `resumed` into a new `abandoned-<time>-from-step-<resumed>`
    folder of `root`; the line to log, or None when there is none (rank 0, after every rank loaded)."""
    newer = [s for s in folders.scan(root)[0] if s > resumed]
    if not newer:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    k, target = 0, root / f"{ABANDONED}{stamp}-from-step-{resumed}"
    while target.exists():
        k += 1
        target = root / f"{ABANDONED}{stamp}-{k}-from-step-{resumed}"
    target.mkdir()
    for step in newer:
        os.rename(folders.step_dir(root, step), folders.step_dir(target, step))
    folders.fsync_dir(root)
    names = ", ".join(f"step-{s}" for s in newer)
    return (
        f"checkpoint: resuming from step-{resumed} starts a new line of training; the newer {names} "
        f"moved to {target} (kept, never resumed or pruned)"
    )
