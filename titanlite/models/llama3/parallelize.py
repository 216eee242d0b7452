"""The Llama 3 parallelize plan: TP, then activation checkpointing, then compile, then data parallelism.

Driven only by the config and the ParallelDims. The tensor-parallel plan (which projections are split
column- or row-wise) is Llama's and lives here; every other step is model-agnostic and lives under
`titanlite/parallelisms/`, addressed through the model's `Units`.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titanlite.config import JobConfig
from titanlite.dtypes import DTYPES
from titanlite.parallelisms.activation_checkpoint import apply_ac
from titanlite.parallelisms.compile import apply_compile
from titanlite.parallelisms.fsdp2 import apply_fsdp2
from titanlite.parallelisms.parallel_dims import ParallelDims
from titanlite.parallelisms.reshard import ReshardPlan
from titanlite.parallelisms.simple_fsdp import MixedPrecisionPolicy, apply_reshard, data_parallel
from titanlite.parallelisms.units import Units


def llama_units(model: nn.Module) -> Units:
    return Units.of(model, "layers")


def parallelize_llama(model: nn.Module, dims: ParallelDims, cfg: JobConfig) -> nn.Module:
    units = llama_units(model)
    if dims.tp_enabled:
        apply_tp(model, dims.tp_mesh, loss_parallel=dims.loss_parallel)
    ac = apply_ac(units.blocks, cfg.activation_checkpoint)
    if cfg.compile.enable and "model" in cfg.compile.components:
        apply_compile(model, units, ac, cfg, dims)
    if dims.dp_enabled:
        param_dtype = DTYPES[cfg.training.mixed_precision_param]
        reduce_dtype = DTYPES[cfg.training.mixed_precision_reduce]
        reshard = ReshardPlan.of(
            cfg.parallelism.fsdp_reshard_after_forward, len(units.blocks), gathers=dims.dp_mode != "replicate"
        )
        if cfg.parallelism.dp_impl == "fsdp2":
            apply_fsdp2(model, units, dims.submesh(dims.dp_dim_names), param_dtype, reduce_dtype, reshard)
        else:
            data_parallel(
                model,
                dims.submesh(dims.dim_names),
                dims.dp_mode,
                MixedPrecisionPolicy(param_dtype, reduce_dtype),
                dp_ndim=len(dims.dp_dim_names),
            )
            apply_reshard(model, units, reshard)
    return model


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """Megatron-style TP with sequence parallelism on norms, the residual stream and the embedding
    output; with loss parallel the logits stay sharded on the vocab dim (the loss runs under
    `loss_parallel()` without gathering them). A pipeline stage plans only the root modules it holds;
    between stages the hidden states travel sequence-sharded, as local tensors."""
    roots = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    held = {name: style for name, style in roots.items() if getattr(model, name) is not None}
    if held:
        parallelize_module(model, tp_mesh, held)
    for block in model.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            },
        )
