"""The data positions of every replica group, as one rank knows them: what a checkpoint saves for the rank and
what a recovering group receives.

Group K reads the virtual shards of the job's dp ranks K x dp .. (K + 1) x dp - 1 (`RunPlan.data_dp_rank`), so
no two groups read the same samples and no group can know another's positions from its own. After each step the
ranks of the same index in every group exchange their loader states (`encode`/`decode`, through the replica
group's manager), and each keeps the table of the last committed state of every group: a group that failed
rejoins with its own position of the last step it committed (its samples are delayed, never skipped or repeated),
and a checkpoint written by one group resumes every group exactly. A group the table does not hold starts its
shards from their beginning (nothing of them was trained).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from titanlite.errors import CheckpointError

TABLE_KEY = "replica_groups"
"""The key of the table in a saved state: a loader state without it is from a run without replica groups."""


class GroupLoaderStates:
    """A rank's loader (`data.loader.TokenLoader`) and the last committed loader states of the other groups,
    with the loader's `state_dict`/`load_state_dict` protocol (the checkpoint code saves and loads it as it
    would the loader)."""

    def __init__(self, loader: Any, replica_id: int):
        self.loader, self.replica_id = loader, replica_id
        self.others: dict[int, dict] = {}

    @property
    def dataset(self) -> Any:
        """The loader's dataset (the checkpoint's record of the data reads it)."""
        return self.loader.dataset

    def table(self) -> dict[str, dict]:
        """Every known group's loader state, this group's as it is now."""
        own = {self.replica_id: self.loader.state_dict()}
        return {str(k): v for k, v in sorted({**self.others, **own}.items())}

    def state_dict(self) -> dict:
        return {TABLE_KEY: self.table()}

    def load_state_dict(self, state: dict) -> None:
        """This group's position from a saved or received table; the other groups' kept for them."""
        if TABLE_KEY not in state:
            raise CheckpointError(
                "the checkpoint's data loader state is of a run without replica groups: a replica group "
                "(fault_tolerance.enable) resumes only from a replica group's checkpoint (docs/fault_tolerance.md)"
            )
        table = {int(k): v for k, v in state[TABLE_KEY].items()}
        if self.replica_id in table:
            self.loader.load_state_dict(table.pop(self.replica_id))
        self.others = table

    def trained_steps(self) -> int | None:
        """The steps this group's data has served since the job began (None where the loader cannot tell)."""
        return self.loader.state_dict().get("step")

    def adopt(self, states: dict[int, dict]) -> None:
        """The other groups' states of a committed step (`decode`)."""
        self.others.update({k: v for k, v in states.items() if k != self.replica_id})


def encode(state: dict, replica_id: int, group_size: int) -> tuple[torch.Tensor, bytes]:
    """(lengths [group_size] int64 with this group's payload length in its slot, the payload): the first of
    the exchange's two sums (the lengths, so every group sizes the second, the payloads, alike)."""
    payload = json.dumps(state, separators=(",", ":")).encode()
    lengths = torch.zeros(group_size, dtype=torch.int64)
    lengths[replica_id] = len(payload)
    return lengths, payload


def payload_rows(payload: bytes, replica_id: int, lengths: torch.Tensor) -> torch.Tensor:
    """[group_size, max length] uint8, this group's payload in its row and zeros elsewhere: summed over the
    groups, every row holds its group's payload."""
    rows = torch.zeros(len(lengths), int(lengths.max()), dtype=torch.uint8)
    rows[replica_id, : len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return rows


def decode(rows: torch.Tensor, lengths: torch.Tensor) -> dict[int, dict]:
    """Each group's loader state from the summed rows (a group that did not take part sent length 0)."""
    out = {}
    for k, n in enumerate(lengths.tolist()):
        if n:
            out[k] = json.loads(bytes(rows[k, :n].tolist()))
    return out
