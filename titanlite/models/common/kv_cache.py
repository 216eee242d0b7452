"""A KV cache for generation: the keys and values of the positions generated so far, per block, so each new
token runs the model over itself alone instead of over the whole sequence again. The dense families'
attention reads and writes it (`Transformer.forward` with `cache`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

LayerKV = tuple[torch.Tensor, torch.Tensor, int]
"""One block's view of a `KVCache`: its key and value buffers [b, kv_heads, max_len, head_dim] and the
position its new tokens start at."""


@dataclass
class KVCache:
    """Keys and values of the positions generated so far, per block: each new token then runs the model
    over itself alone instead of over the whole sequence again. Filled from position 0 by a prompt, then
    one token at a time (`Transformer.forward` with `cache`)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    pos: int = 0
    """Positions held."""

    def check(self, new: int) -> int:
        """The position `new` tokens start at; advances past them (they are written by this forward)."""
        if new > 1 and self.pos:
            raise ValueError("a KV cache takes a prompt at position 0, then one token at a time")
        if self.pos + new > self.k[0].shape[2]:
            raise ValueError(f"the KV cache holds {self.k[0].shape[2]} positions, {self.pos + new} asked")
        pos, self.pos = self.pos, self.pos + new
        return pos
