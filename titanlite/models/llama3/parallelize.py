"""Llama 3's part of the parallelize plan: its block container and its tensor-parallel plan.

The framework applies every parallelism, in its own order (`titanlite/parallelisms/parallelize.py`);
what is Llama's is which modules form the blocks; its projections split as every dense decoder's
(`models/common/tensor_parallel.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from titanlite.models.common.tensor_parallel import dense_tp_plan
from titanlite.parallelisms.units import Units

if TYPE_CHECKING:
    from titanlite.parallelisms.tensor_parallel.unit import TensorParallelPlan


def llama_units(model: nn.Module) -> Units:
    return Units.of(model, "layers")


def llama_tp_plan(loss_parallel: bool) -> TensorParallelPlan:
    """The dense decoder's plan (`models/common/tensor_parallel.py`), without QK-norm."""
    return dense_tp_plan(loss_parallel)
