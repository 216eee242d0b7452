"""A KV cache for generation: the keys and values of the positions generated so far, per block, so each new
token runs the model over itself alone instead of over the whole sequence again. The dense families'
attention reads and writes it (`Decoder.forward` with `cache`, `attend_cached`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titanlite.models.common.attention import Mask, attend

LayerKV = tuple[torch.Tensor, torch.Tensor, int]
"""One block's view of a `KVCache`: its key and value buffers [b, kv_heads, max_len, head_dim] and the
position its new tokens start at."""


@dataclass
class KVCache:
    """Keys and values of the positions generated so far, per block: each new token then runs the model
    over itself alone instead of over the whole sequence again. Filled from position 0 by a prompt, then
    one token at a time (`Decoder.forward` with `cache`)."""

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

    @classmethod
    def empty(
        cls,
        like: torch.Tensor,
        layers: int,
        batch: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        v_head_dim: int | None = None,
    ) -> KVCache:
        """An empty cache of `layers` blocks for `max_len` positions, on `like`'s device in its dtype; the
        values `v_head_dim` wide where they differ from the keys (latent attention)."""
        widths = (head_dim, v_head_dim or head_dim) * layers
        make = [torch.zeros(batch, kv_heads, max_len, w, device=like.device, dtype=like.dtype) for w in widths]
        return cls(make[::2], make[1::2])


def attend_cached(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, kv: LayerKV | None, scale: float | None = None
) -> torch.Tensor:
    """Attention of q [b, s, heads, d] over k, v [b, s, kv_heads, d] -> [b, s, heads * d], what every
    dense family's attention runs once its heads are projected and rotated. With a block's `kv`
    (generation) the new keys and values are written into the cache and the queries attend every
    position so far: causally for a prompt (from position 0, `KVCache.check`), every key for a single
    new token. `scale`: the softmax scale, None for 1 / sqrt(head dim)."""
    bsz, seq = q.shape[:2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    causal = True
    if kv is not None:
        k_all, v_all, pos = kv
        k_all[:, :, pos : pos + seq], v_all[:, :, pos : pos + seq] = k, v
        k, v = k_all[:, :, : pos + seq], v_all[:, :, : pos + seq]
        causal = seq > 1
    return attend(q, k, v, mask, causal, scale).transpose(1, 2).reshape(bsz, seq, -1)
