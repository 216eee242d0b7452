"""A job of replica groups splits its data as one run whose data-parallel replicas are the groups would
(`RunPlan.data_dp_rank`, `data_dp_degree`, the global batch, the virtual shards): group K's ranks read what
the ranks of dp replica K read, so the groups' average is that run's step."""

from __future__ import annotations

import pytest
import torch
from builders import config

from titanlite.planning.run_plan import RunPlan
from titanlite.run.loader import build_loader

GROUPS, GROUP_WORLD = 2, 2
KEYS = dict(training__seq_len=32, training__local_batch_size=2, training__global_batch_size=16)


def group_plan(replica_id: int) -> RunPlan:
    """Group `replica_id` of GROUPS, each of GROUP_WORLD ranks sharding its data."""
    ft = dict(fault_tolerance__enable=True, fault_tolerance__group_size=GROUPS, fault_tolerance__replica_id=replica_id)
    return RunPlan.build(config(None, KEYS, ft), GROUP_WORLD)


@pytest.fixture(scope="module")
def replicated() -> RunPlan:
    """One run of GROUPS x GROUP_WORLD ranks: dp_replicate GROUPS x dp_shard GROUP_WORLD."""
    mesh = dict(parallelism__data_parallel_replicate_degree=GROUPS, parallelism__data_parallel_shard_degree=-1)
    return RunPlan.build(config(None, KEYS, mesh), GROUPS * GROUP_WORLD)


def data_of(plan: RunPlan, rank: int) -> tuple[int, int]:
    return plan.data_dp_rank(plan.dims.dp_rank_of(rank)), plan.data_dp_degree


def first_batch(plan: RunPlan, rank: int) -> torch.Tensor:
    return next(iter(build_loader(plan, plan.dims.dp_rank_of(rank), report=False))).inputs


@pytest.mark.parametrize("replica_id", range(GROUPS))
def test_group_k_reads_what_dp_replica_k_of_one_run_reads(replicated, replica_id):
    group = group_plan(replica_id)
    assert group.global_batch * group.replica_groups == replicated.global_batch == 16
    assert (group.grad_accum, group.virtual_shards, group.samples_per_shard) == (
        replicated.grad_accum,
        replicated.virtual_shards,
        replicated.samples_per_shard,
    )
    for rank in range(GROUP_WORLD):
        assert data_of(group, rank) == data_of(replicated, replica_id * GROUP_WORLD + rank)
    rank = GROUP_WORLD - 1
    ours = first_batch(group, rank)
    assert torch.equal(ours, first_batch(replicated, replica_id * GROUP_WORLD + rank))
    other = (replica_id + 1) % GROUPS  # the control: another replica's rank reads other samples
    assert not torch.equal(ours, first_batch(replicated, other * GROUP_WORLD + rank))


def test_the_groups_read_disjoint_data_and_a_run_without_groups_all_of_it():
    # The negative control: the groups' ranks differ, and without fault tolerance one run reads every shard.
    ranks = [data_of(group_plan(k), r) for k in range(GROUPS) for r in range(GROUP_WORLD)]
    assert sorted(ranks) == [(i, GROUPS * GROUP_WORLD) for i in range(GROUPS * GROUP_WORLD)]
    alone = RunPlan.build(config(None, KEYS), GROUP_WORLD)
    assert [data_of(alone, r) for r in range(GROUP_WORLD)] == [(0, GROUP_WORLD), (1, GROUP_WORLD)]
    assert alone.global_batch == 16 and group_plan(0).global_batch == 8
