"""Pipeline parallelism's keys of the `parallelism` section, and the schedules that split each backward.
Torch-free, importing only `titanlite.config.ranges`: `titanlite/parallelisms/config.py` composes it into
the `parallelism` section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from titanlite.config.ranges import POSITIVE, _range

SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble",)
"""Pipeline schedules that run each backward as an input half and a weight half (zero bubble)."""


@dataclass
class Pipeline:
    """Pipeline parallel: the model's blocks split into stages over rank groups."""

    pipeline_parallel_degree: int = field(default=1, metadata=POSITIVE)
    """Pipeline stages' rank groups: the outermost mesh dim (pp, dp_replicate, dp_shard, tp). 1 = no PP."""
    pipeline_parallel_schedule: Literal["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble"] = "1F1B"
    """torch.distributed.pipelining's schedule; the interleaved ones hold several stages per rank."""
    pipeline_parallel_microbatch_size: int = field(default=1, metadata=POSITIVE)
    """Samples per pipeline microbatch; the local batch must be a multiple of it."""
    pipeline_parallel_stages_per_rank: int = field(
        default=-1, metadata=_range(low=0, low_open=True, also=-1, also_means="by schedule")
    )
    """-1 = 1 for GPipe and 1F1B, 2 for the interleaved schedules."""
    pipeline_parallel_split_points: list[int] = field(default_factory=list)
    """Block indices at which stages 1, 2, ... begin (stages-1 ascending values); empty = balanced, counting
    the embedding and the output as one block each (the first and last stage take one block fewer)."""
