"""Which checkpoints belong to the line of training a run continues, and what happens to the others.

The rule: the checkpoints in `<dump_folder>/<checkpoint.folder>/` are one line of training, and a run
resumes its newest step. A run that resumes from an older step (`checkpoint.load_step N` while `step-M`
folders with M > N exist; or the newest folders being damaged or model-only, so that the newest usable
one is older) starts a new line from N. The newer folders belong to the line it leaves: once every
rank has loaded step N, before any trains, rank 0 moves them into

    <checkpoint.folder>/abandoned-<UTC time>-from-step-N/step-M

with one `os.rename` each (the same file system: nothing is copied) and logs one line naming them and
that folder. Nothing is deleted: they are there to inspect, to load (move one back, or name it in
`checkpoint.initial_load_path`) or to delete by hand. No resume lists them and `keep_latest_k` never
prunes them (`folders.scan` sees only `step-N` names at the top), so the new line's saves can neither
overwrite nor prune them, and the next plain launch resumes the newest step of the new line.

Why move them rather than refuse: naming an older step is the request to train from it; the newer
steps stay exactly as they were, one folder away, and the line says where. Why not leave them in place:
the run would overwrite them one by one as it reaches their steps, pruning would count them as the
newest (`keep_latest_k 1` would delete the checkpoint the run has just written and keep an old one),
and a later plain launch would resume the old line.

Restarts: torch elastic restarts every rank with the same command line, `load_step N` included. The
first attempt has already moved the old line aside, so `step-M` folders newer than N that this launch
wrote itself (their marker's `launch` is this launch's `TORCHELASTIC_RUN_ID`) are the new line: a
restarted attempt resumes the newest of them, as after any crash, instead of going back to N.
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
