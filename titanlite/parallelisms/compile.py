"""Per-transformer-block torch.compile.

Each block is compiled separately with `fullgraph=True`: blocks are identical, so one compiled graph
(recompiled only per distinct layer id guard) serves all of them and compile time does not grow with
depth as a whole-model graph would; the embedding, final norm and output stay eager, their cost is small
and the output's loss-parallel DTensor handling stays out of the graph. A fully checkpointed block keeps
its eager checkpoint outside the compiled body (see activation_checkpoint.py).
"""

from __future__ import annotations

import torch
from torch import nn

from titanlite.config import Compile


def apply_compile(blocks: nn.ModuleDict, cfg: Compile) -> None:
    for block in blocks.values():
        if getattr(block, "_ac_full", False):
            block._ac_inner = torch.compile(block._ac_inner, backend=cfg.backend, fullgraph=True)
        else:
            block.compile(backend=cfg.backend, fullgraph=True)
