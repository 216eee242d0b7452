"""The `float8` section of the config: float8 training's keys, beside the conversion that reads them (`unit.py`).
Torch-free and importing nothing of titanlite: the config's schema (titanlite/config/schema.py) composes it into
`JobConfig`, which the launcher and `--help` read before any torch process exists."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class Float8:
    """Float8 training of the linear layers (torchao, the `float8` extra; docs/float8.md). The master
    weights, gradients and optimizer state stay in high precision; checkpoints hold those."""

    enable: bool = False
    """Convert the model's linear layers to float8 training."""
    recipe: Literal["tensorwise", "rowwise", "mxfp8"] = "tensorwise"
    """Scaling: `tensorwise` (one scale per tensor), `rowwise` (one per row: more accurate, slower; compiled
    with inductor's emulate_precision_casts) or `mxfp8` (blocks of 32, on GPUs with MX support)."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output", "auto_filter_small_kn"])
    """Linear layers left in high precision: those whose name contains an entry (comma-separated);
    `auto_filter_small_kn` also leaves those too small for float8 to gain (by shape). An entry that names
    no layer, or filters that leave none converted, is a warning; tied embeddings need `output` here."""
    all_gather: bool = False
    """Gather the weights in float8 (tensorwise): half the bytes of bf16, under every compile scope (the
    eager prefetcher's flat gathers too); not under tensor or pipeline parallelism."""
    emulate: bool = False
    """Emulate float8 matmuls in high precision (a CPU, or a GPU without float8): numerics only."""
