"""Qwen3's part of the parallelize plan: its block container. Its projections split as every dense
decoder's, with the per-head q/k norms (`models/common/tensor_parallel.py`, named by
`models/common/dense_spec.py`)."""

from __future__ import annotations

from torch import nn

from titanlite.parallelisms.units import Units


def qwen3_units(model: nn.Module) -> Units:
    return Units.of(model, "layers")
