"""`head_local`: a tensor every tp rank holds whole, used by each rank for its own attention heads only.

A replicated DTensor (say, a latent attention's rotary key part, one head shared by all heads) feeds a
computation each tp rank runs on its slice of the heads: each rank's gradient of it is then one part of
a sum over the ranks, which the conversion declares (`Partial`), so DTensor reduces it where it meets the
replicated weights that made it. A plain tensor (no tensor parallelism) passes as is.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial


def head_local(t: torch.Tensor) -> torch.Tensor:
    """`t` as this rank's plain tensor, its gradient summed over the ranks in backward (module docstring)."""
    if not isinstance(t, DTensor):
        return t
    return t.to_local(grad_placements=tuple(Partial() for _ in t.placements))
