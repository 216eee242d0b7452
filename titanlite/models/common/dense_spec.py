"""The spec of a dense decoder family (Llama 3, Qwen3): what such a family registers alike, around what is
its own (its model, flavors, shape keys and checks, block container, HF adapter). Causal or block-causal
masks, context parallelism, the output projection tied when its args say so, the dense tensor-parallel
plan and what tp must divide (`tensor_parallel.py`), and the dense activation and step-cost models, each
with QK-norm or without."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from torch import nn

from titanlite.models.common.dense_activations import activation_bytes
from titanlite.models.common.dense_cost import step_cost
from titanlite.models.common.tensor_parallel import dense_tp_divisible, dense_tp_styles
from titanlite.models.registry import ModelSpec, ParallelSeams, PlanningTerms, ShapeRules
from titanlite.parallelisms.units import Units


def dense_spec(
    name: str,
    model_cls: Callable[..., nn.Module],
    flavors: dict[str, Any],
    units: Callable[[nn.Module], Units],
    keys: tuple[str, ...],
    check_args: Callable[[Any], str | None],
    hf_adapter: Any,
    *,
    qk_norm: bool = False,
) -> ModelSpec:
    """The `ModelSpec` of dense decoder family `name` (module docstring); `qk_norm`: its attention
    normalises each head's queries and keys, which the activation and cost models count."""
    return ModelSpec(
        name=name,
        model_cls=model_cls,
        flavors=flavors,
        units=units,
        shape=ShapeRules(
            keys=keys,
            check_args=check_args,
            attn_mask_types=("causal", "block_causal"),
            tied_embeddings=lambda args: args.tie_embeddings,
        ),
        parallel=ParallelSeams(
            tp_styles=partial(dense_tp_styles, qk_norm=qk_norm),
            tp_divisible=dense_tp_divisible,
            context_parallel=True,
        ),
        planning=PlanningTerms(
            activation_bytes=partial(activation_bytes, qk_norm=qk_norm), step_cost=partial(step_cost, qk_norm=qk_norm)
        ),
        hf_adapter=hf_adapter,
    )
