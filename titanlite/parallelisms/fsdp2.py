"""The baseline: torch's FSDP2 `fully_shard` per transformer block and on the root."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def apply_fsdp2(model: nn.Module, dp_mesh: DeviceMesh, param_dtype: torch.dtype | None,
                reduce_dtype: torch.dtype | None, reshard_last: bool, reshard_blocks: bool) -> None:
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        reshard = reshard_blocks and (reshard_last or i < len(blocks) - 1)
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_last and reshard_blocks)
