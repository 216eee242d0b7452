"""Every replica group's data position (`fault_tolerance/data_states.py`): the exchange's encoding survives
the sum over the groups, and a group's loader resumes exactly from the table a peer or checkpoint hands it."""

from __future__ import annotations

import json
import random

import pytest
import torch
from builders import loader

from titanlite.errors import CheckpointError
from titanlite.fault_tolerance import data_states
from titanlite.fault_tolerance.data_states import TABLE_KEY, GroupLoaderStates

GROUPS, SEQ, LBS = 2, 16, 2
"""Two groups of one data-parallel rank each: the job's global batch is LBS x GROUPS."""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    path = tmp_path_factory.mktemp("ft_data") / "data.jsonl"
    docs = [f"doc {i}: " + " ".join(rng.choices(words, k=rng.randint(3, 40))) for i in range(40)]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def group_loader(data, replica_id: int):
    """Group `replica_id`'s loader: the job's dp rank `replica_id` of GROUPS (`RunPlan.data_dp_rank`)."""
    return loader(data, rank=replica_id, dp=GROUPS, gbs=LBS * GROUPS, lbs=LBS, seq_len=SEQ)


def batches(it, n: int) -> list[torch.Tensor]:
    return [next(it).inputs.clone() for _ in range(n)]


def exchange(states: dict[int, dict], group_size: int) -> dict[int, dict]:
    """The two sums of `ReplicaGroup.exchange_data`, over the groups in `states`, in plain torch."""
    encoded = {k: data_states.encode(s, k, group_size) for k, s in states.items()}
    lengths = sum(lengths for lengths, _ in encoded.values())
    rows = sum(data_states.payload_rows(payload, k, lengths) for k, (_, payload) in encoded.items())
    return data_states.decode(rows, lengths)


def test_the_exchange_round_trips_every_groups_state(data):
    states = {}
    for k in range(GROUPS):
        dl = group_loader(data, k)
        batches(iter(dl), 2 + k)
        states[k] = json.loads(json.dumps(dl.state_dict()))
    assert states[0] != states[1]  # the control: the groups' positions differ, so a mix-up would show
    assert exchange(states, GROUPS) == states


def test_a_group_that_did_not_take_part_is_absent_and_the_others_intact():
    states = {0: {"step": 3, "shards": {"0": {"offset": 255}}}, 2: {"step": 1, "note": "é" * 300}}
    assert exchange(states, 3) == states  # group 1 sent length 0; bytes of 255 and multi-byte text survive


def test_a_group_resumes_from_the_table_at_the_step_after_it(data):
    group = GroupLoaderStates(group_loader(data, 1), replica_id=1)
    it = iter(group.loader)
    trained = batches(it, 3)
    other = group_loader(data, 0)
    batches(iter(other), 3)
    group.adopt({0: other.state_dict(), 1: {"never": "adopted"}})  # its own entry is the live loader's
    table = json.loads(json.dumps(group.state_dict()))  # what a checkpoint or a peer's state holds
    assert group.trained_steps() == 3
    later = batches(it, 2)  # trained after the table was taken: lost with the group

    fresh = GroupLoaderStates(group_loader(data, 1), replica_id=1)
    fresh.load_state_dict(table)
    assert fresh.trained_steps() == 3
    assert torch.equal(next(iter(fresh.loader)).inputs, later[0])  # the 4th step's batch
    assert fresh.others == {0: json.loads(json.dumps(other.state_dict()))}  # kept for group 0
    # The negative control: a loader that did not load the table starts over, at the first step's batch.
    restarted = next(iter(group_loader(data, 1))).inputs
    assert torch.equal(restarted, trained[0]) and not torch.equal(restarted, later[0])


def test_a_group_the_table_does_not_hold_starts_from_its_beginning(data):
    first = next(iter(group_loader(data, 1))).inputs
    other = group_loader(data, 0)
    batches(iter(other), 2)
    joining = GroupLoaderStates(group_loader(data, 1), replica_id=1)
    joining.load_state_dict({TABLE_KEY: {"0": other.state_dict()}})
    assert joining.trained_steps() == 0 and set(joining.others) == {0}
    assert torch.equal(next(iter(joining.loader)).inputs, first)


def test_a_state_without_the_table_is_refused_in_one_line(data):
    plain = group_loader(data, 1)
    batches(iter(plain), 1)
    group = GroupLoaderStates(group_loader(data, 1), replica_id=1)
    with pytest.raises(CheckpointError, match="of a run without replica groups") as refused:
        group.load_state_dict(plain.state_dict())
    assert "\n" not in str(refused.value)
    assert group.trained_steps() == 0  # nothing loaded
