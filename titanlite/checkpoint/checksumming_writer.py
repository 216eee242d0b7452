"""DCP's file writer that checksums the files a rank wrote (the checksums of `folders.py`'s marker)."""

from __future__ import annotations

import json
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from titanlite.checkpoint.folders import CHECKSUMS, checksum


class ChecksummingWriter(FileSystemWriter):
    """DCP's file writer that also checksums the files this rank wrote, right after writing them.

    The list goes to `checksums/<prefix>.json` (the prefix is the rank's DCP file prefix), read by
    `folders.complete`. DCP finishes a save (and `.metadata` appears) only after every rank's `write_data`
    returned, so rank 0 finds every list when it completes the folder.
    """

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        future = super().write_data(plan, planner)
        names = sorted({result.storage_data.relative_path for result in future.wait()})
        folder = Path(self.path)
        sums = {name: checksum(folder / name) for name in names}
        out = folder / CHECKSUMS / f"{plan.storage_data.prefix}.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(sums))
        return future
