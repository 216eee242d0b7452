"""Model families: what the trainer, the tools and the checkpoint code need to know of a model.

A family registers one `ModelSpec`; nothing outside `models/<name>/` knows its module names or shapes. It
supplies data and its model; the framework applies every parallelism in its own order
(`titanlite/parallelisms/parallelize.py`) from the family's `units` and `parallel.tp_styles`, and runs the
step (`titanlite/run/step.py`) with the family's `hooks`. The model follows a small protocol: built on the
meta device from its args, `init_weights(seed, buffer_device)`, `model(tokens) -> logits` (with `positions`
and `mask` under `block_causal`), and `model.args` with `vocab_size` (replaced by the tokenizer's),
`max_seq_len`, `n_layers`, `num_params()`, `flops_per_token(seq_len)`, a field per `spec.shape.keys` and
optionally `shape_value(key)` (the value as built). A pipeline stage's model takes
and returns hidden states. Built-in families are imported on first use (`BUILTIN`); others register with
`register_model` (docs/configuration.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from titanlite.errors import CheckpointError, ConfigError
from titanlite.models.cost import ModelCost
from titanlite.parallelisms.units import Units

if TYPE_CHECKING:  # types only: the launcher's preflight reads the specs without DTensor
    from titanlite.parallelisms.step_context import ExtraLoss
    from titanlite.parallelisms.tensor_parallel.unit import TensorParallelStylesFn

BUILTIN = {
    "llama3": "titanlite.models.llama3",
    "qwen3": "titanlite.models.qwen3",
    "qwen3_moe": "titanlite.models.qwen3_moe",
    "deepseek_v3": "titanlite.models.deepseek_v3",
}
_MODELS: dict[str, ModelSpec] = {}


@dataclass(frozen=True)
class ShapeRules:
    """What shapes the family builds and trains: read by the plan before any rank starts and by the
    resume policy."""

    keys: tuple[str, ...] = ()
    """The args fields that the `model.*` config keys of the same name override: the one list behind the
    overrides, the start-up line and the resume policy (a change of any of them stops a resume)."""
    check_args: Callable[[Any], str | None] = field(default=lambda args: None)
    """Why a shape (flavor + `model.*` overrides) cannot be built, or None."""
    check_layout: Callable[[Any, Any], str | None] = field(default=lambda args, dims: None)
    """Why a shape (its args) cannot train on a layout (`ParallelDims`), or None."""
    attn_mask_types: tuple[str, ...] = ("causal",)
    """The `model.attn_mask_type` values the family's forward takes (module docstring); others are
    refused."""
    tied_embeddings: Callable[[Any], bool] = field(default=lambda args: False)
    """Whether the embedding and the output projection share one weight (a pipeline's first and last
    stage cannot both hold it; float8 must leave the projection, `output`, in high precision)."""
    output: str = "output"
    """The output projection's module name."""
    high_precision: tuple[str, ...] = ()
    """Linear layers float8 training never converts, by name fragment (an MoE router's gate: float8's
    rounding would change which experts its scores pick)."""


@dataclass(frozen=True)
class ParallelSeams:
    """The seams the family's model declares for the parallelisms that need one: without a seam, a
    degree above one is refused before any rank starts."""

    tp_styles: TensorParallelStylesFn | None = None
    """The family's tensor-parallel styles (data: module name -> torch `ParallelStyle`), given whether the
    loss is vocab-parallel."""
    tp_divisible: Callable[[Any], dict[str, int]] = field(default=lambda args: {})
    """Sizes the tensor-parallel degree must divide (e.g. attention heads), checked in the plan."""
    context_parallel: bool = False
    """The model's attention declares the context-parallel seam (`parallelisms/context_parallel/unit.py`)."""
    num_experts: Callable[[Any], int] | None = None
    """The experts of each MoE layer, where the model's experts declare the expert-parallel seam
    (`parallelisms/expert_parallel/unit.py`)."""


@dataclass(frozen=True)
class TrainingHooks:
    """What the family adds to the framework's step (`titanlite/run/step.py`, the trainer)."""

    extra_loss: ExtraLoss | None = None
    """A term added to each training microbatch's loss after the model's forward (e.g. a mixture of
    experts' load-balancing loss, which the model records in its forward), a scalar on the model's
    device; None: cross-entropy only. Validation reports the cross-entropy alone. Under pipeline
    parallelism it is called with the last stage's module, and needs `extra_loss_across_stages`."""
    extra_loss_across_stages: bool = False
    """The model's forward as a pipeline stage before the last returns (hidden states, what `extra_loss`
    needs of its layers and of the stages before it), and the last stage keeps what it was handed, so the
    extra term covers every stage's layers; False: pipeline parallelism refuses a family with an extra
    loss (each stage would hold a part of it)."""
    after_step: Callable[[nn.Module], None] | None = None
    """Called by every rank after each optimizer step (it may run a collective), e.g. to update a router's
    balancing bias from the step's token counts; None: nothing."""
    step_metrics: Callable[[nn.Module], dict[str, float]] | None = None
    """The family's own scalars for the step line, metrics.jsonl and TensorBoard (names declared in
    `metrics/schema.py` with `family=True`, e.g. a router's load imbalance), since the last log; every
    rank calls it at each log (it may run a collective); None: none."""


@dataclass(frozen=True)
class PlanningTerms:
    """The family's terms in the dry run and the layout search (`titanlite/planning/`)."""

    activation_bytes: Callable[..., dict[str, int]] | None = None
    """The memory estimate's activation model `(args, layout) -> {part: bytes, "peak": bytes, "held": bytes}`
    ("held": what a microbatch keeps from its forward to its backward); None: no dry run."""
    step_cost: Callable[[Any, int, int], ModelCost] | None = None
    """The step-time model's cost per token `(args, seq_len, compute dtype bytes) -> ModelCost`
    (`titanlite/models/cost.py`); None: no layout search."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_cls: Callable[..., nn.Module]
    flavors: dict[str, Any]
    """Flavor name -> model args (a dataclass with the protocol's fields)."""
    units: Callable[[nn.Module], Units]
    """The model's blocks and root modules: the unit every parallelism works per (AC and compile wrap a
    block, FSDP gathers one, a pipeline stage holds whole ones; the memory estimate counts them)."""
    shape: ShapeRules = ShapeRules()
    parallel: ParallelSeams = ParallelSeams()
    hooks: TrainingHooks = TrainingHooks()
    planning: PlanningTerms = PlanningTerms()
    hf_adapter: Any = None
    """Hugging Face names and conversions (`checkpoint/hf.py`); None: no HF import/export."""

    def resolved_shape(self, args: Any) -> dict[str, Any]:
        """Shape key -> its value in `args` as built (`args.shape_value`, else the field)."""
        value = getattr(args, "shape_value", None)
        return {key: value(key) if value else getattr(args, key) for key in self.shape.keys}

    def require_hf_adapter(self) -> Any:
        """The family's Hugging Face adapter, or one line saying it has none (import, export, generation)."""
        if self.hf_adapter is None:
            raise CheckpointError(f"model {self.name!r} has no Hugging Face adapter")
        return self.hf_adapter


def register_model(spec: ModelSpec) -> None:
    _MODELS[spec.name] = spec


def get_model_spec(name: str) -> ModelSpec:
    if name not in _MODELS and name in BUILTIN:
        register_model(importlib.import_module(BUILTIN[name]).SPEC)
    if name not in _MODELS:
        known = sorted(set(_MODELS) | set(BUILTIN))
        raise ConfigError(f"config key 'model.name' = {name!r}: expected one of {', '.join(known)}")
    return _MODELS[name]
