"""Qwen3's part of the parallelize plan: its block container and its tensor-parallel plan, the dense
decoder's with the per-head q/k norms (`models/common/tensor_parallel.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from titanlite.models.common.tensor_parallel import dense_tp_plan
from titanlite.parallelisms.units import Units

if TYPE_CHECKING:
    from titanlite.parallelisms.tensor_parallel.unit import TensorParallelPlan


def qwen3_units(model: nn.Module) -> Units:
    return Units.of(model, "layers")


def qwen3_tp_plan(loss_parallel: bool) -> TensorParallelPlan:
    return dense_tp_plan(loss_parallel, qk_norm=True)
