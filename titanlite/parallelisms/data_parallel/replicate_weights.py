"""`ReplicateWeights`: a tensor-parallel style for a module whose weights every tp rank holds whole."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


class ReplicateWeights(ParallelStyle):
    """Every tp rank holds the module's weights whole (Replicate DTensors) and computes with them on
    tensors that are the same on every tp rank (a module fed replicated activations, such as a MoE layer
    whose tokens are gathered first): the module reads its weights' local tensors, so each rank's
    gradients are already whole and equal, and nothing is reduced over tp."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicate(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, param in list(mod.named_parameters(recurse=False)):
                placed = distribute_tensor(param.data, mesh, [Replicate()], src_data_rank=None)
                mod.register_parameter(pname, nn.Parameter(placed, requires_grad=param.requires_grad))

        return distribute_module(module, device_mesh, replicate)
