"""The baseline: torch's FSDP2 `fully_shard` per transformer block and on the root."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from titanlite.parallelisms.data_parallel.reshard import ReshardPolicy
from titanlite.parallelisms.units import Units


def apply_fsdp2(
    model: nn.Module,
    units: Units,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    reshard: ReshardPolicy,
) -> None:
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block, freed in zip(units.blocks.values(), reshard.blocks):
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=freed)
    # The root's inputs stay as they come: token ids, or a pipeline stage's inputs, whose hidden states
    # arrive in the compute dtype already and whose other tensors (a family's carried sums, in float32)
    # must not be rounded to it.
    root_mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    fully_shard(model, mesh=dp_mesh, mp_policy=root_mp, reshard_after_forward=reshard.root)
