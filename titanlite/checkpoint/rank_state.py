"""Per-rank state saved next to the DCP tensors: the data loader position and the RNG states.

DCP reshards tensors, but this state is per rank and not a tensor: each rank writes `rank_state/rank-<r>.pt`
into the step folder before it is completed (the completion marker lists these files too), and a resuming rank
picks what it needs from the old ranks' files. Data loader: the first rank of each dp rank holds its state
(`WorldLayout.first_rank_of`); with the same dp degree new dp rank d loads old dp rank d's, with another the
old states are merged (`merge_loader_states`) and every new rank keeps the virtual shards it owns, so the
global batches are those an uninterrupted run would have seen. RNG states (torch CPU, CUDA, python `random`):
new rank r restores old rank r's, or old rank `r % old_world_size` when the world grew. The resharding rule:
docs/parallelism.md and docs/checkpoints.md.
"""

from __future__ import annotations

import os
import pickle
import random
from collections.abc import Callable
from pathlib import Path

import torch

from titanlite.checkpoint.folders import rank_state_file
from titanlite.data.loader import merge_loader_states
from titanlite.errors import CheckpointError
from titanlite.parallelisms.parallel_dims import WorldLayout


def path_of(folder: Path, rank: int) -> Path:
    return folder / rank_state_file(rank)


def capture(dataloader, *, rank: int, dp_rank: int, dp_degree: int, device: torch.device) -> dict:
    """This rank's state right now (between steps)."""
    rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    return {
        "rank": rank,
        "dp_rank": dp_rank,
        "dp_degree": dp_degree,
        "rng": rng,
        "dataloader": dataloader.state_dict() if dataloader is not None else None,
    }


def write(folder: Path, rank: int, state: dict) -> None:
    path = path_of(folder, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def read(folder: Path, rank: int) -> dict:
    path = path_of(folder, rank)
    try:
        return torch.load(path, weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"checkpoint {folder}: cannot read {path.name} ({e})") from None


def loader_state_for(dp_rank: int, dp_degree: int, old: WorldLayout, read_rank: Callable[[int], dict]) -> dict | None:
    """The data loader state that new dp rank `dp_rank` of `dp_degree` resumes from (module docstring);
    `old` is the layout the checkpoint was saved under (its first rank of each dp rank holds that dp rank's
    state: `WorldLayout.first_rank_of`).

    `read_rank(r)` returns old rank r's saved state; only the files needed are read.
    """
    if old.dp == dp_degree:
        state = read_rank(old.first_rank_of(dp_rank))
        _check_dp_rank(state, dp_rank)
        return state["dataloader"]
    states = []
    for d in range(old.dp):
        state = read_rank(old.first_rank_of(d))
        _check_dp_rank(state, d)
        states.append(state["dataloader"])
    if any(s is None for s in states):
        return None
    return merge_loader_states(states)


def _check_dp_rank(state: dict, dp_rank: int) -> None:
    if state["dp_rank"] != dp_rank:
        raise CheckpointError(
            f"rank state of rank {state['rank']} belongs to dp rank {state['dp_rank']}, expected {dp_rank}"
        )


def restore_rng(state: dict, device: torch.device) -> None:
    rng = state["rng"]
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    if device.type == "cuda" and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"], device)
