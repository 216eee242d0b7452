"""What pipeline parallelism needs from the other keys and the model family, checked before any rank starts.

With pipeline_parallel_degree > 1: no validation, a causal mask, untied embeddings, a family's extra loss
term that crosses stages, and the reductions and compilation its schedule can run; the stage layout's own
rules are `StageLayout.of`'s. With degree 1, none of its keys is set.
"""

from __future__ import annotations

from typing import Any

from titanlite.config import SPLIT_BACKWARD_SCHEDULES, JobConfig
from titanlite.errors import ConfigError
from titanlite.parallelisms.parallel_dims import ParallelDims


def check_pipeline(cfg: JobConfig, dims: ParallelDims, spec: Any, args: Any) -> None:
    """The unit's rules (`parallelism.ParallelismUnit.rules`), on or off."""
    p = cfg.parallelism
    pipelined, split_backward = p.pipeline_parallel_degree > 1, p.pipeline_parallel_schedule in SPLIT_BACKWARD_SCHEDULES
    if not pipelined:
        if p.pipeline_parallel_split_points or p.pipeline_parallel_stages_per_rank != -1:
            raise ConfigError(
                "config keys 'parallelism.pipeline_parallel_split_points' and '...stages_per_rank' need "
                "pipeline_parallel_degree > 1"
            )
        if p.pipeline_parallel_microbatch_size != 1:
            raise ConfigError(
                f"parallelism.pipeline_parallel_microbatch_size {p.pipeline_parallel_microbatch_size} needs "
                "pipeline_parallel_degree > 1 (gradient accumulation without stages: training.global_batch_size)"
            )
        return
    if cfg.validation.enable:
        raise ConfigError(
            "validation.enable is not supported with pipeline_parallel_degree > 1 yet (held-out batches would "
            "have to run through the pipeline schedule); turn one of them off"
        )
    if p.dp_impl == "fsdp2" and p.gradient_reduction == "per_microbatch":
        raise ConfigError(
            "parallelism.gradient_reduction per_microbatch is not available for fsdp2 with pipeline parallelism: "
            "torch's pipeline stage reduces FSDP2 gradients once per schedule step (use per_step or simple_fsdp)"
        )
    if p.dp_impl == "simple_fsdp" and split_backward and p.gradient_reduction == "per_step":
        raise ConfigError(
            f"parallelism.gradient_reduction per_step is not available for simple_fsdp with the "
            f"{p.pipeline_parallel_schedule} schedule: its weight backward differentiates the parameters, which "
            "the once-per-step path takes out of the autograd graph (use auto or per_microbatch)"
        )
    if split_backward and cfg.compile.enable and "model" in cfg.compile.components:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule {p.pipeline_parallel_schedule} cannot run compiled blocks: "
            "its split input/weight backward would run each compiled block's one backward node twice "
            "(use Interleaved1F1B, or compile.components = loss)"
        )
    mask = cfg.model.attn_mask_type
    if mask != "causal":
        raise ConfigError(
            f"model.attn_mask_type {mask} is not supported with pipeline_parallel_degree > 1 yet (the stages "
            "after the first would need the batch's positions): use causal or no pipeline parallelism"
        )
    if spec.shape.tied_embeddings(args):
        raise ConfigError("pipeline parallelism needs untied embeddings: the first and last stage differ")
    if spec.hooks.extra_loss is not None and not spec.hooks.extra_loss_across_stages:
        raise ConfigError(
            f"pipeline parallelism does not support model {spec.name}'s extra loss term "
            "(its stages would each hold a part of it): set pipeline_parallel_degree 1"
        )
