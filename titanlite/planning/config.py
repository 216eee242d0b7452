"""The `layout_search` section of the config: the GPU kind planned for and how many layouts are shown and
confirmed, beside the GPU figures (`gpus.py`). Torch-free, importing only `titanlite.config.ranges`: the
config's schema (titanlite/config/schema.py) composes it into `JobConfig`, which the launcher and `--help` read
before any torch process exists."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from titanlite.config.ranges import POSITIVE

GpuName = Literal["h100", "h100-96gb-500w", "h200", "a100", "b200"]
"""The GPU kinds the layout search can plan for; `titanlite.planning.gpus.GPU_KINDS` holds their figures."""


@dataclass
class LayoutSearch:
    """The layout search (`--plan`, titanlite/tools/layout_search.py)."""

    gpu: GpuName = "h100"
    """GPU kind to plan for (titanlite/planning/gpus.py lists their figures and sources)."""
    top: int = field(default=5, metadata=POSITIVE)
    """Ranked layouts shown."""
    confirm: int = field(default=1, metadata=POSITIVE)
    """Fastest layouts planned again by the dry run itself (the best that fits is written)."""
