"""RankGroup: how the ranks agree while saving and resuming, on the training process group.

Every rank runs the same checkpoint steps; where one rank can fail alone (a full disk, an unusable copy)
the ranks first agree (`all_ok`), so that all of them skip or stop together instead of leaving the others
waiting in DCP's collectives. Rank 0 decides what is read (`broadcast`) and learns what each rank found
(`gather`). Without a process group (one process) each is the identity. Main thread only: the async
writer's thread has a process group of its own (`async_save.py`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class RankGroup:
    """The collectives of the checkpoint code over the default process group (module docstring)."""

    def __init__(self, device: torch.device, world_size: int):
        self.device, self.world_size = device, world_size

    def all_ok(self, ok: bool) -> bool:
        """Whether `ok` holds on every rank."""
        if not dist.is_initialized():
            return ok
        flag = torch.tensor([int(ok)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def broadcast(self, obj):
        """Rank 0's `obj`, on every rank."""
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        if not dist.is_initialized():
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out
