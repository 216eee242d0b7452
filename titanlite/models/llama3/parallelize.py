"""The Llama 3 parallelize plan: TP, then activation checkpointing, then compile, then data parallelism.

Driven only by the config and the ParallelDims; each step lives in its own module under
`titanlite/parallelisms/`.
"""

from __future__ import annotations

import torch
from torch import nn

from titanlite.config import JobConfig
from titanlite.parallelisms.activation_checkpoint import apply_ac
from titanlite.parallelisms.compile import apply_compile
from titanlite.parallelisms.fsdp2 import apply_fsdp2
from titanlite.parallelisms.parallel_dims import ParallelDims
from titanlite.parallelisms.simple_fsdp import (
    MixedPrecisionPolicy,
    ReshardAfterForward,
    data_parallel,
    set_reshard_after_forward,
)
from titanlite.parallelisms.tensor_parallel import apply_tp

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parallelize_llama(model: nn.Module, dims: ParallelDims, cfg: JobConfig) -> nn.Module:
    if dims.tp_enabled:
        apply_tp(model, dims.tp_mesh, loss_parallel=not cfg.parallelism.disable_loss_parallel)
    apply_ac(model.layers, cfg.activation_checkpoint)
    if cfg.compile.enable and "model" in cfg.compile.components:
        apply_compile(model, cfg, dims)
    if dims.dp_enabled:
        param_dtype = DTYPES[cfg.training.mixed_precision_param]
        reduce_dtype = DTYPES[cfg.training.mixed_precision_reduce]
        reshard = cfg.parallelism.fsdp_reshard_after_forward
        if cfg.parallelism.dp_impl == "fsdp2":
            dp_mesh = dims.submesh(dims.dp_dim_names)
            apply_fsdp2(model, dp_mesh, param_dtype, reduce_dtype,
                        reshard_last=reshard == "always", reshard_blocks=reshard != "never")
        else:
            mesh = dims.submesh(dims.dim_names)
            data_parallel(model, mesh, dims.dp_mode, MixedPrecisionPolicy(param_dtype, reduce_dtype),
                          dp_ndim=len(dims.dp_dim_names))
            apply_simple_fsdp_reshard(model, reshard, dims.dp_mode)
    return model


def apply_simple_fsdp_reshard(model: nn.Module, policy: str, mode: str) -> None:
    """Reshard-after-forward for SimpleFSDP: blocks (all but the last under `default`), root under `always`."""
    if policy == "never" or mode == "replicate":
        return
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        set_reshard_after_forward(block, policy == "always" or i < len(blocks) - 1)
    if policy == "always":
        for name, child in model.named_children():
            if name != "layers":
                set_reshard_after_forward(child, True)
    ReshardAfterForward(model)
