"""Gradient clipping by the global norm, correct for DTensor gradients: what both step runners call after a
step's last backward (`step.LocalRunner`, `pipeline.PipelineRunner`), below them in the layers."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of `grads` (one or more tensors of one mesh, or plain ones), in their dtype.

    On CPU each tensor's norm accumulates in float64: torch's CPU float32 norm of a tensor of 10^5-10^6
    elements drifts by 1e-6-1e-4 relative (the debug model's first gradient norm: 1.5356675 in float32,
    1.5357589 exactly), and by a different amount for each shard size, so one process, replicas and
    shards would each log, and clip by, a slightly different norm of the same gradients. Elsewhere
    torch's own per-tensor norms are used as they are.

    The float64 norms are taken one tensor at a time (`dtype` a keyword of vector_norm): DTensor's
    sharding rule for `_foreach_norm` in torch 2.15 reads its positional `dtype` as reduction dims and
    fails. On CPU `_foreach_norm` runs this same per-tensor kernel, so the result is bit for bit the
    same."""
    if grads[0].device.type == "cpu":
        norms = [torch.linalg.vector_norm(g, 2.0, dtype=torch.float64) for g in grads]
    else:
        norms = list(torch._foreach_norm(grads, 2.0))
    return torch.linalg.vector_norm(torch.stack(norms)).to(grads[0].dtype)


@torch.no_grad()
def clip_grad_norm_(
    parameters: list[torch.Tensor], max_norm: float, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Clip by the total L2 norm over every rank's shards; returns the (global) norm before clipping.

    The norm of DTensor gradients is computed per mesh (a Partial result) and reduced to the full value,
    so it is the same number on every rank and equals the single-process norm; gradients on several meshes
    (expert-parallel experts) add their squared norms. `group`: ranks holding
    other parameters (pipeline stages), whose squared norms are added.
    """
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = []
    for params in by_mesh.values():  # DTensor ops take one mesh at a time (the experts have their own)
        norm = _total_norm([p.grad for p in params])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if len(norms) == 1 and group is None:
        total = norms[0]
    else:
        squared = torch.stack(norms).pow(2).sum() if norms else torch.zeros(())
        if group is not None:
            dist.all_reduce(squared, group=group)
        total = squared.sqrt()
    if max_norm > 0:
        for params in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total
