"""Float8 training: the model's linear layers compute their matmuls in float8 (torchao), first in the order.

torchao's `Float8Linear` keeps the weight a high-precision parameter under the same name and casts inside each
matmul, so every parallelism applied after it wraps a layer whose parameters are unchanged. Every `nn.Linear`
converts except those named in `float8.filter_fqns` (the output projection by default) and, with
`auto_filter_small_kn`, those too small to gain (`layer_filter`). `rules` checks, before any rank starts, the
`float8` extra's version, the recipe and settings, and a tied output left in high precision; `check_device`
wants a GPU with float8 (sm89 or newer) or `float8.emulate`. The keys and what composes: docs/float8.md.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import logging
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from titanlite import torch_support
from titanlite.config import ConfigError, JobConfig
from titanlite.config.schema import first_set_key
from titanlite.parallelisms.parallel_dims import ParallelDims
from titanlite.parallelisms.parallelism import ApplyArgs, ParallelismUnit, StepHook

logger = logging.getLogger("titanlite")

SUPPORTED_TORCHAO = ((0, 18), (0, 18))
"""The torchao releases (major, minor) tried with every supported torch (`torch_support`), eager and compiled."""
AUTO_FILTER = "auto_filter_small_kn"
FLOAT8_CAPABILITY = {"tensorwise": (8, 9), "rowwise": (8, 9)}
"""The oldest CUDA compute capability whose tensor cores run each recipe's matmuls."""


def torchao_version() -> str | None:
    """The installed torchao's version, without importing it (the launcher's preflight stays light)."""
    if importlib.util.find_spec("torchao") is None:
        return None
    return importlib.metadata.version("torchao")


def rules(cfg: JobConfig, dims: ParallelDims, tied_output: str | None = None) -> None:
    """Why float8 cannot run with these settings, as one `ConfigError` line; nothing when it can (or when
    it is off and none of its switches is set). `tied_output`: the name of the output projection when it
    shares the embedding's weight (`ShapeRules.output`), else None."""
    f8 = cfg.float8
    if not f8.enable:
        stray = first_set_key(f8, ("all_gather", "emulate", "recipe", "filter_fqns"))
        if stray is not None:
            raise ConfigError(f"float8.{stray} is set but float8.enable is not: add --float8.enable, or drop it")
        return
    version = torchao_version()
    if version is None:
        raise ConfigError(
            "float8.enable needs torchao, the `float8` extra: run with TITANLITE_EXTRAS=float8 "
            "(run_train.sh installs it), or pip install 'titanlite[float8]'"
        )
    release = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    low, high = SUPPORTED_TORCHAO
    if not low <= release <= high:
        raise ConfigError(
            f"float8: torchao {version} with torch {torch.__version__} is not a tested pair "
            f"(torchao {low[0]}.{low[1]} with torch {torch_support.range_text()}): pip install 'titanlite[float8]'"
        )
    if f8.recipe == "mxfp8":
        raise ConfigError("float8.recipe mxfp8 is not supported yet: use tensorwise or rowwise")
    if tied_output is not None and not any(f in tied_output for f in f8.filter_fqns if f != AUTO_FILTER):
        raise ConfigError(
            f"float8 with tied embeddings: the output projection {tied_output!r} shares the embedding's weight, "
            "which must stay in high precision (a float8 layer's weight is cast, and with float8.all_gather "
            f"gathered as float8 for the embedding too); float8.filter_fqns {','.join(f8.filter_fqns)} does not "
            f"name it: add {tied_output} to float8.filter_fqns"
        )
    if f8.all_gather and f8.recipe != "tensorwise":
        raise ConfigError(
            f"float8.all_gather needs float8.recipe tensorwise: a {f8.recipe} weight has a scale per row, "
            "which each rank cannot apply to its own shard before the gather"
        )
    if dims.pp_enabled and f8.all_gather:
        raise ConfigError(
            "float8.all_gather with pipeline parallelism is not supported yet: set --no-float8.all_gather"
        )
    if dims.tp_enabled and f8.all_gather:
        raise ConfigError(
            "float8.all_gather with tensor parallelism is not supported yet (SimpleFSDP gathers 2-D sharded "
            "weights in the training dtype): set --no-float8.all_gather"
        )
    if f8.all_gather and (not dims.dp_enabled or dims.dp_mode == "replicate"):
        raise ConfigError(
            "float8.all_gather gathers sharded weights, and this layout shards none (data_parallel_shard_degree "
            "1): set --no-float8.all_gather"
        )


ROWWISE_INDUCTOR_CONFIG: dict[str, Any] = {"emulate_precision_casts": True}
"""Inductor settings of a compiled rowwise run, as torchao and TorchTitan set them for the recipe: fused
into one kernel, an RMSNorm and the rowwise cast after it otherwise skip eager's rounding of each
intermediate to its dtype, and compiled rowwise training has produced NaN where eager does not."""


def inductor_config(cfg: JobConfig) -> dict[str, Any]:
    """The inductor settings this run's float8 needs (`ROWWISE_INDUCTOR_CONFIG` for the rowwise recipe,
    none otherwise). The compiler patches them (`ParallelismUnit.compile_options`) into its own units' compiles
    (`config_patches` / `torch.compile(options=...)`), never into inductor's global config, so another
    run in the same process compiles with inductor's defaults."""
    f8 = cfg.float8
    return dict(ROWWISE_INDUCTOR_CONFIG) if f8.enable and f8.recipe == "rowwise" else {}


def check_device(cfg: JobConfig, device: torch.device) -> None:
    """Refuse a device whose matmuls cannot run the recipe, unless emulation was asked for."""
    f8 = cfg.float8
    if not f8.enable or f8.emulate:
        return
    if device.type != "cuda":
        raise ConfigError(f"float8 on a {device.type.upper()} needs float8.emulate (numerics only, no speed-up)")
    have, need = torch.cuda.get_device_capability(device), FLOAT8_CAPABILITY[f8.recipe]
    if have < need:
        raise ConfigError(
            f"float8.recipe {f8.recipe} needs a GPU of compute capability {need[0]}.{need[1]} or newer; "
            f"{torch.cuda.get_device_name(device)} is {have[0]}.{have[1]} (float8.emulate runs the numerics)"
        )


def layer_filter(filter_fqns: list[str], recipe: str) -> Callable[[nn.Module, str], bool]:
    """Which linear layers train in float8, as torchao's `module_filter_fn`: not named by an entry of
    `filter_fqns`, both sizes multiples of 16 (float8 matmuls need it), and with `auto_filter_small_kn` not
    too small to gain (torchao's own filter, which checks the names and sizes too, with its H100-measured
    thresholds for the recipe)."""
    names = [f for f in filter_fqns if f != AUTO_FILTER]
    if AUTO_FILTER in filter_fqns:
        from torchao.float8 import _auto_filter_for_recipe

        return _auto_filter_for_recipe(recipe, names)
    return lambda module, fqn: (
        not any(f in fqn for f in names) and module.in_features % 16 == 0 and module.out_features % 16 == 0
    )


def converted_weights(model: nn.Module) -> frozenset[str]:
    """The names of the weights of `model`'s float8 layers: those `apply_float8` converted (`layer_filter`
    chose them), read from the model so that the memory estimates count exactly what a run gathers in float8
    (`float8.all_gather`)."""
    from torchao.float8.float8_linear import Float8Linear  # imported by apply_float8 already

    return frozenset(f"{name}.weight" for name, m in model.named_modules() if isinstance(m, Float8Linear))


def apply_float8(model: nn.Module, cfg: JobConfig, high_precision: tuple[str, ...] = ()) -> None:
    """Convert the chosen linear layers of `model` (on the meta device) in place, and say how many;
    `high_precision`: the family's layers that never convert (`ShapeRules.high_precision`)."""
    # Its import logs a warning for each GPU kernel library a CPU machine cannot load, and torch one for
    # an enum torchao registers with pytree: advice for torchao's developers, not for a run.
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)
    f8 = cfg.float8
    linear_names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for entry in f8.filter_fqns:
        if entry != AUTO_FILTER and not any(entry in name for name in linear_names):
            logger.warning(
                f"float8.filter_fqns entry {entry!r} matches no linear layer of this model (their names: "
                f"{_names_text(linear_names)}): it leaves nothing in high precision"
            )
    # FSDP2 gathers float8 through torchao's weight wrapper; SimpleFSDP through its own (`float8_gather`).
    fsdp2_gathers = f8.all_gather and cfg.parallelism.dp_impl == "fsdp2"
    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(f8.recipe), emulate=f8.emulate, enable_fsdp_float8_all_gather=fsdp2_gathers
    )
    convert_to_float8_training(
        model, config=config, module_filter_fn=layer_filter([*f8.filter_fqns, *high_precision], f8.recipe)
    )
    converted = sum(isinstance(m, Float8Linear) for m in model.modules())
    linears = len(linear_names)
    if converted == 0:
        why = (
            f"{AUTO_FILTER} leaves out every layer below torchao's H100 sizes for {f8.recipe}; name the layers "
            "to keep in high precision instead, e.g. --float8.filter_fqns output"
            if AUTO_FILTER in f8.filter_fqns
            else "every layer is filtered out by name or has a size that is not a multiple of 16"
        )
        logger.warning(
            f"float8.enable converts 0 of {linears} linear layers (float8.filter_fqns {','.join(f8.filter_fqns)}): "
            f"this run trains without float8; {why}"
        )
        return
    logger.info(
        f"float8 {f8.recipe}{' (emulated)' if f8.emulate else ''}: {converted} of {linears} linear layers; the "
        "others, the weights' master copies and the optimizer state in high precision"
    )


def _names_text(names: list[str], shown: int = 4) -> str:
    """`names` in a line: the first few distinct ones with the block index written as N, and how many."""
    distinct = list(dict.fromkeys(re.sub(r"\.\d+\.", ".N.", n) for n in names))
    more = f", ... ({len(distinct)} in all)" if len(distinct) > shown else ""
    return ", ".join(distinct[:shown]) + more


class Float8Refresh(StepHook):
    """The step hook: the float8 gathers' scales and bits from the weights as they are now, before a step's
    first forward (`gather.Float8Gathers.refresh`; nothing where the weights are gathered in the training
    dtype)."""

    def before_step(self, model: nn.Module) -> None:
        from titanlite.parallelisms.float8.gather import float8_gathers_of  # DTensor: where ranks run

        refresh = float8_gathers_of(model)
        if refresh is not None:
            refresh()


def _rules(cfg: JobConfig, dims: ParallelDims, spec: Any, args: Any) -> None:
    rules(cfg, dims, spec.shape.output if spec.shape.tied_embeddings(args) else None)


def _apply(a: ApplyArgs) -> dict:
    """First: the layers every parallelism then wraps keep their parameters."""
    apply_float8(a.model, a.cfg, a.high_precision)
    return {}


def _gathers(a: ApplyArgs) -> None:
    """After data parallelism: the float8 layers' weights gathered as float8 bits (`float8.all_gather`)."""
    if not (a.cfg.float8.all_gather and a.dims.dp_enabled):
        return
    from titanlite.parallelisms.float8.gather import gather_in_float8, gather_in_float8_fsdp2

    if a.cfg.parallelism.dp_impl == "fsdp2":
        gather_in_float8_fsdp2(a.model)
    else:
        gather_in_float8(a.model, torch_support.dtype(a.cfg.training.mixed_precision_param))


UNIT = ParallelismUnit(
    name="float8",
    on=lambda cfg, dims: cfg.float8.enable,
    rules=_rules,
    apply=_apply,
    gathers=_gathers,
    step_hook=lambda dims: Float8Refresh(),
    compile_options=inductor_config,
    check_device=check_device,
)
"""Float8 training as one unit (`parallelism.ParallelismUnit`): its memory is the memory estimate's
(`Layout.float8_gather`, `converted_weights`)."""
