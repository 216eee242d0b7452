"""The `fault_tolerance` section of the config, beside the code that reads it (`replica_group.py`). Torch-free,
importing only `titanlite.config.ranges`: the config's schema (titanlite/config/schema.py) composes it into
`JobConfig`, which the launcher and `--help` read before any torch process exists."""

from __future__ import annotations

from dataclasses import dataclass, field

from titanlite.config.ranges import NON_NEGATIVE, POSITIVE, TIMEOUT

DEFAULT_LIGHTHOUSE = "http://localhost:29510"
"""torchft's default lighthouse address (its `TORCHFT_LIGHTHOUSE` default)."""


@dataclass
class FaultTolerance:
    """Replica groups (torchft): this run is one group of a job whose groups average their gradients each step
    and keep training while a failed group restarts and rejoins (docs/fault_tolerance.md; the `ft` extra)."""

    enable: bool = False
    """Run as replica group `replica_id` of `group_size`, through torchft's lighthouse (`lighthouse`)."""
    replica_id: int = field(default=0, metadata=NON_NEGATIVE)
    """This group's index, 0 .. group_size - 1: which part of the data it reads (group K reads what dp
    replica K of a `parallelism.data_parallel_replicate_degree = group_size` run reads)."""
    group_size: int = field(default=1, metadata=POSITIVE)
    """The number of replica groups of the job (each started with its own run_train.sh and dump folder)."""
    min_replica_size: int = field(default=1, metadata=POSITIVE)
    """The fewest live groups a step commits with; with fewer the groups wait (up to quorum_timeout_seconds)."""
    lighthouse: str = ""
    """The lighthouse's address (http://host:port); empty = the TORCHFT_LIGHTHOUSE environment variable, else
    http://localhost:29510. Start one with `scripts/python.sh -m titanlite.tools.lighthouse`."""
    quorum_timeout_seconds: float = field(default=60.0, metadata=TIMEOUT)
    """How long a step waits for a quorum of at least min_replica_size groups before the group stops with
    one line (a lighthouse that cannot be reached fails after connect_timeout_seconds)."""
    timeout_seconds: float = field(default=60.0, metadata=TIMEOUT)
    """How long the gradient average across groups, the commit vote and a recovering group's state transfer
    may take; a group that is late beyond it is left out of the step (the step is retried without it)."""
    connect_timeout_seconds: float = field(default=30.0, metadata=TIMEOUT)
    """How long connecting to the lighthouse and to a peer group's manager may take."""


def lighthouse_address(ft: FaultTolerance, environ: dict[str, str]) -> str:
    """The lighthouse this group joins: `fault_tolerance.lighthouse`, else TORCHFT_LIGHTHOUSE, else torchft's
    default."""
    return ft.lighthouse or environ.get("TORCHFT_LIGHTHOUSE") or DEFAULT_LIGHTHOUSE
