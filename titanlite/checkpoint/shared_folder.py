"""Every rank writes its part of a checkpoint into one folder, which rank 0 completes (`folders.py`): on
several nodes that folder must be on a file system they all share. A node-local path (each node's own
`/scratch`, a relative `./outputs` in a checkout that is not shared) gives every node a folder of its
own, and no checkpoint would ever hold every rank's files.

`check_shared` finds that out at start-up, before any training: rank 0 writes a token file with a
random name into the checkpoint folder and every rank looks for it (for a few seconds, for file systems
that show new files late); a rank that does not see it stops the run with one line naming the folder.
"""

from __future__ import annotations

import socket
import time
import uuid
from pathlib import Path

import torch.distributed as dist

from titanlite.errors import ConfigError

_WAIT_SECONDS = 5.0


def check_shared(root: Path, rank: int, world_size: int) -> None:
    """Collective over the default process group: every rank sees the file rank 0 writes into `root`."""
    if world_size == 1 or not dist.is_initialized():
        return
    token = [f".shared-check-{uuid.uuid4().hex}" if rank == 0 else None]
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        (root / token[0]).write_text(socket.gethostname())
    dist.broadcast_object_list(token, src=0)
    path = root / str(token[0])
    deadline = time.monotonic() + _WAIT_SECONDS
    while not (seen := path.is_file()) and time.monotonic() < deadline:
        time.sleep(0.2)
    views: list[tuple[bool, str] | None] = [None] * world_size
    dist.all_gather_object(views, (seen, socket.gethostname()))
    if rank == 0:
        path.unlink(missing_ok=True)
    blind = [(r, host) for r, (ok, host) in enumerate(views) if not ok]  # type: ignore[misc]
    if blind:
        r, host = blind[0]
        others = f" and {len(blind) - 1} more" if len(blind) > 1 else ""
        raise ConfigError(
            f"checkpoint folder {root} is not shared by every rank: rank {r} (host {host}){others} does not "
            f"see the file rank 0 (host {views[0][1]}) wrote there; every node must write its part of a "
            "checkpoint into the same folder (a shared file system, not node-local disk)"
        )
