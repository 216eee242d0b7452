"""Checkpoint folders on disk: names, the completion marker, checksums, validation, choice and pruning.

A crash can come at any point of a save, so a save writes into `step-N.partial`, and only once DCP's
`.metadata` (every rank's data) and every rank's state file are there does rank 0 write `complete.json`
(each file's size and CRC-32, fsynced) and rename the folder to `step-N` in one `os.rename`: a `step-N`
folder was complete when it appeared, and its marker catches files truncated or changed later. Every
rank writes into the one folder rank 0 completes, so it must be shared (`shared_folder.py`). Deleting
is two steps, `retire` (one rename to `<name>.deleting`, a name no lister sees) and the caller's
`discard`, so no resume picks a half-deleted folder. The layout and the protocol in full:
docs/checkpoints.md.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("titanlite")

MARKER = "complete.json"
FORMAT_VERSION = 2
"""1: file sizes only; 2: also a CRC-32 per file (`checksums` in the marker)."""
CHECKSUMS = "checksums"


def rank_state_file(rank: int) -> str:
    """Where rank `rank`'s rank-state file goes in a checkpoint folder (`rank_state.py`)."""
    return f"rank_state/rank-{rank:05d}.pt"


_CHUNK = 4 << 20
_COMPLETE = re.compile(r"^step-(\d+)$")
_PARTIAL = re.compile(r"^step-(\d+)\.partial$")
RETIRED = ".deleting"
_RETIRED = re.compile(r"^step-\d+(\.partial)?\.deleting(-\d+)?$")

Discard = Callable[[Path], None]
"""Deletes a retired folder (`retire`): at once, or later on another thread (`purge.Purger.submit`)."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}"


def partial_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}.partial"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checksum(path: Path) -> str:
    """CRC-32 of a file's bytes as 8 hex digits, read in 4 MiB chunks (zlib releases the GIL while it sums)."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def retire(path: Path) -> Path:
    """Rename the folder `path` to a retired name no other folder has (module docstring); returns it."""
    k = 0
    while (target := path.with_name(path.name + RETIRED + (f"-{k}" if k else ""))).exists():
        k += 1
    os.rename(path, target)
    fsync_dir(path.parent)
    return target


def retired(root: Path) -> list[Path]:
    """The retired folders in `root` (a deletion a crash interrupted, or one not yet done)."""
    if not root.is_dir():
        return []
    return sorted(entry for entry in root.iterdir() if entry.is_dir() and _RETIRED.match(entry.name))


def delete_now(path: Path) -> None:
    """A `Discard` that deletes on the calling thread (single-process tools, tests)."""
    shutil.rmtree(path, ignore_errors=True)


def prepare(root: Path, step: int, discard: Discard) -> Path:
    """An empty `step-N.partial` (a leftover from an interrupted save of the same step is retired)."""
    path = partial_dir(root, step)
    if path.exists():
        discard(retire(path))
    path.mkdir(parents=True)
    return path


def referenced_files(path: Path) -> list[str]:
    """The data files DCP's metadata in `path` refers to (one or more per rank that wrote tensors)."""
    # Imported here: DCP (with DTensor, half a second) is not needed to scan folders or read markers,
    # which the launcher's preflight does before any rank starts.
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(str(path)).read_metadata().storage_data or {}
    return sorted({info.relative_path for info in storage.values()})


def missing_files(path: Path, world_size: int, model_only: bool) -> list[str]:
    """Files a complete checkpoint of `world_size` ranks needs that are not in `path`: DCP's data files
    and, for the training state, every rank's rank-state file."""
    needed = referenced_files(path)
    if not model_only:
        needed += [rank_state_file(r) for r in range(world_size)]
    return [rel for rel in needed if not (path / rel).is_file()]


def complete(root: Path, step: int, info: dict, discard: Discard) -> Path:
    """Write the marker into `step-N.partial` and publish it as `step-N`; returns the final path.

    A folder without every rank's files (ranks writing into folders of their own) raises
    FileNotFoundError and stays partial. An existing `step-N` (a new seed checkpoint's step 0; the newer
    steps of a run resumed from an older one are moved aside before it trains, `lineage.py`) is retired
    first and discarded once the new folder is in place.
    """
    partial, final = partial_dir(root, step), step_dir(root, step)
    if missing := missing_files(partial, info.get("world_size", 1), info.get("model_only", False)):
        raise FileNotFoundError(
            f"rank 0 does not see {len(missing)} of the ranks' files in it ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}): every rank must write into the same folder"
        )
    sums: dict[str, str] = {}
    lists = partial / CHECKSUMS
    if lists.is_dir():  # the ranks' checksums of their data files (ChecksummingWriter)
        for part in sorted(lists.iterdir()):
            sums.update(json.loads(part.read_text()))
        shutil.rmtree(lists)
    files = {str(p.relative_to(partial)): p.stat().st_size for p in sorted(partial.rglob("*")) if p.is_file()}
    for rel in files:
        if rel not in sums:  # .metadata and the small rank-state files
            sums[rel] = checksum(partial / rel)
    marker = {"format": FORMAT_VERSION, "step": step, **info, "files": files, "checksums": sums}
    tmp = partial / (MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump(marker, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, partial / MARKER)
    fsync_dir(partial)
    replaced = retire(final) if final.exists() else None
    os.rename(partial, final)
    fsync_dir(root)
    if replaced is not None:
        discard(replaced)
    return final


def problem(path: Path) -> str | None:
    """Why the checkpoint folder `path` cannot be loaded, or None if it is complete and intact."""
    marker_path = path / MARKER
    if not marker_path.is_file():
        return f"no completion marker {MARKER}"
    try:
        marker = json.loads(marker_path.read_text())
        files = marker["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable completion marker {MARKER} ({e})"
    for rel, size in files.items():
        f = path / rel
        if not f.is_file():
            return f"missing file {rel}"
        actual = f.stat().st_size
        if actual != size:
            return f"file {rel} has {actual} bytes, the marker says {size} (truncated or overwritten)"
    try:
        absent = [rel for rel in referenced_files(path) if rel not in files]
    except Exception as e:  # any failure to read DCP's metadata makes the folder unusable
        return f"unreadable DCP metadata .metadata ({type(e).__name__}: {e})"
    if absent:
        return f"file {absent[0]} that DCP's metadata refers to is missing (written on another node?)"
    return None


def checksum_problem(path: Path, marker: dict, rank: int = 0, world_size: int = 1) -> str | None:
    """The first file of `rank`'s share whose CRC-32 differs from the marker's, or None.

    The files are dealt out largest first, so `world_size` ranks each read about 1/world of the folder.
    A marker without checksums (format 1) has nothing to verify.
    """
    sums = marker.get("checksums") or {}
    files = sorted(sums, key=lambda rel: (-marker["files"].get(rel, 0), rel))
    for rel in files[rank::world_size]:
        try:
            actual = checksum(path / rel)
        except OSError as e:
            return f"cannot read file {rel} ({e.strerror})"
        if actual != sums[rel]:
            return f"file {rel} has CRC-32 {actual}, the marker says {sums[rel]} (corrupted)"
    return None


def read_marker(path: Path) -> dict:
    return json.loads((path / MARKER).read_text())


def scan(root: Path) -> tuple[list[int], list[int]]:
    """(steps of `step-N` folders, steps of `step-N.partial` folders), each ascending."""
    if not root.is_dir():
        return [], []
    done, partial = [], []
    for entry in root.iterdir():
        if not entry.is_dir():
            continue
        if m := _COMPLETE.match(entry.name):
            done.append(int(m.group(1)))
        elif m := _PARTIAL.match(entry.name):
            partial.append(int(m.group(1)))
    return sorted(done), sorted(partial)


def retire_partials(root: Path, discard: Discard) -> None:
    """Report, retire and discard the interrupted saves (`.partial`) in `root`."""
    for step in scan(root)[1]:
        path = partial_dir(root, step)
        logger.warning(f"checkpoint {path} is incomplete (no completion marker: an interrupted save); removing it")
        discard(retire(path))


@dataclass
class Choice:
    """The checkpoint a run resumes from (rank 0 decides; every rank receives the same Choice)."""

    path: str | None = None
    marker: dict | None = None
    error: str | None = None


def choose(root: Path, load_step: int, discard: Discard, rejected: dict[int, str] | None = None) -> Choice:
    """Pick the folder to resume from: `load_step`, or the newest usable one (-1).

    Interrupted saves (`.partial`) are reported, retired and discarded. A damaged `step-N` is reported in one line
    and the previous one is tried; `rejected` holds the steps the caller found damaged already (a
    checksum mismatch, reported by the caller) with the reason. A model-only checkpoint past step 0
    (`last_save_model_only`) holds no optimizer or data state, so it is skipped when looking for the
    newest one to resume from. Damaged or non-resumable folders only, with nothing usable behind them,
    is an error: silently starting over would overwrite them.

    The checks here are cheap (marker, file sizes, DCP metadata); checksums are verified by the caller
    on every rank (`checksum_problem`).
    """
    rejected = rejected or {}
    retire_partials(root, discard)
    done = scan(root)[0]
    if load_step >= 0:
        path = step_dir(root, load_step)
        if load_step not in done:
            have = ", ".join(f"step-{s}" for s in done) or "none"
            return Choice(
                error=f"checkpoint.load_step {load_step}: {path} does not exist (complete checkpoints: {have})"
            )
        if why := rejected.get(load_step) or problem(path):
            return Choice(error=f"checkpoint {path} is unusable: {why}")
        return Choice(str(path), read_marker(path))
    reasons = []
    for step in reversed(done):
        path = step_dir(root, step)
        if step in rejected:
            reasons.append(f"{path.name}: {rejected[step]}")
            continue
        why = problem(path)
        if why is None:
            marker = read_marker(path)
            if not (marker.get("model_only") and step > 0):
                return Choice(str(path), marker)
            why = "holds only the model weights (last_save_model_only), not the training state"
        logger.warning(f"checkpoint {path} is unusable: {why}; trying the previous one")
        reasons.append(f"{path.name}: {why}")
    if reasons:
        return Choice(error=f"no usable checkpoint in {root} ({'; '.join(reasons)})")
    return Choice()


def newest(root: Path) -> Path | None:
    """The newest complete checkpoint folder (model-only ones included), damaged or not; None if none."""
    done = scan(root)[0]
    return step_dir(root, done[-1]) if done else None


def prune(
    root: Path, keep: int, discard: Discard, room: int | None = None, saved: int | None = None
) -> tuple[list[Path], list[Path]]:
    """Retire and discard all but the newest `keep` complete checkpoints (0: keep all), the oldest first
    and at most `room` of them (None: all); returns (the discarded folders by their former names, those
    due but left for a later call).

    `saved`: the step this run saved last. Only the steps up to it are counted, so pruning never
    discards the checkpoint just written, whatever else the folder holds (`lineage.py` moves a left
    line's newer steps aside; this keeps that true even for a folder it did not see)."""
    done = [s for s in scan(root)[0] if saved is None or s <= saved]
    due = [step_dir(root, s) for s in done[:-keep]] if keep > 0 else []
    now = due if room is None else due[:room]
    for path in now:
        discard(retire(path))
    return now, due[len(now) :]
