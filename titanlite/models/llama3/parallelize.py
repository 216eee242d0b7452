"""Llama 3's part of the parallelize plan: its block container. The framework applies every parallelism,
in its own order (`titanlite/parallelisms/parallelize.py`); Llama's projections split as every dense
decoder's (`models/common/tensor_parallel.py`, named by `models/common/dense_spec.py`)."""

from __future__ import annotations

from torch import nn

from titanlite.parallelisms.units import Units


def llama_units(model: nn.Module) -> Units:
    return Units.of(model, "layers")
