"""Context parallelism's key of the `parallelism` section. Torch-free, importing only `titanlite.config.ranges`:
`titanlite/parallelisms/config.py` composes it into the `parallelism` section."""

from __future__ import annotations

from dataclasses import dataclass, field

from titanlite.config.ranges import POSITIVE


@dataclass
class ContextParallel:
    """Context parallel: each sequence split over ranks."""

    context_parallel_degree: int = field(default=1, metadata=POSITIVE)
    """Ranks splitting each sequence (context parallelism): each holds 1/cp of every sequence's tokens (two
    chunks, one from each end, to balance causal attention) and all-gathers the keys and values of the
    whole sequence in attention; parameters are sharded over data_parallel_shard_degree x cp. The mesh
    is (pp, dp_replicate, dp_shard, cp, tp). training.seq_len must be a multiple of 2 x cp."""
