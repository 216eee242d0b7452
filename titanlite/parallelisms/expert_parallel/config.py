"""Expert parallelism's key of the `parallelism` section. Torch-free, importing only `titanlite.config.ranges`:
`titanlite/parallelisms/config.py` composes it into the `parallelism` section."""

from __future__ import annotations

from dataclasses import dataclass, field

from titanlite.config.ranges import POSITIVE


@dataclass
class ExpertParallel:
    """Expert parallel: each MoE layer's experts split over ranks."""

    expert_parallel_degree: int = field(default=1, metadata=POSITIVE)
    """Ranks that split each MoE layer's experts, borrowed from dp_shard x cp (which it must divide); the
    experts are data-parallel over the rest. 1 = none. Qwen3-MoE, SimpleFSDP, TP on the dense parts; compiled
    blocks break the graph at the dispatch (docs/moe.md)."""
