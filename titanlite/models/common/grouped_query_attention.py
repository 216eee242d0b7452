"""Grouped-query attention as every dense decoder builds it: projections `wq`, `wk`, `wv`, `wo` without
biases, RoPE by the family's rotation (Llama 3's interleaved pairs, the Qwen3 families' halves,
`rope_halves.py`), a head width of its own, and optionally RMSNorm over each head's queries and keys
before RoPE (QK-norm, `q_norm` and `k_norm`: the Qwen3 families).

The names are TorchTitan's, which the tensor-parallel styles (`tensor_parallel.py`) and the HF adapters
address. Attention itself, and the KV cache of generation, is `kv_cache.attend_cached`; under context
parallelism the keys and values of the whole sequence are gathered through the `context_parallel` seam
(`parallelisms/context_parallel/unit.py`). Another attention (DeepSeek-V3's latent attention) plugs into
the same block (`decoder.py`) with the same call: (x, cos, sin, mask[, kv])."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from titanlite.models.common.attention import Mask
from titanlite.models.common.kv_cache import LayerKV, attend_cached
from titanlite.models.common.norm import RMSNorm
from titanlite.parallelisms.context_parallel.unit import SequenceShard

Rotate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""RoPE's rotation of heads [b, s, h, d] by (cos, sin) rows: the family's layout."""


class GroupedQueryAttention(nn.Module):
    context_parallel: SequenceShard | None = None
    """Under context parallelism this rank's part of every sequence (set by the framework): the input
    holds some tokens of each sequence and the keys and values of all are gathered; the mask is that of
    the rank's queries against every key, built once per batch outside the blocks (by the step,
    `step.model_forward`, or by a pipeline stage's forward, `Decoder.forward`)."""

    def __init__(
        self, dim: int, n_heads: int, kv_heads: int, head_dim: int, rotate: Rotate, qk_norm_eps: float | None = None
    ):
        super().__init__()
        self.head_dim, self.rotate = head_dim, rotate
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Mask = None, kv: LayerKV | None = None
    ) -> torch.Tensor:
        bsz, seq, _ = x.shape

        def heads(w: nn.Linear) -> torch.Tensor:
            # Under tensor parallelism the projections hold a slice of the heads: infer the local count.
            return w(x).view(bsz, seq, -1, self.head_dim)

        def rotated(w: nn.Linear, norm: RMSNorm | None) -> torch.Tensor:
            h = heads(w)
            return self.rotate(norm(h) if norm is not None else h, cos, sin)

        cp = self.context_parallel if kv is None else None
        if cp is None:
            # Queries first: the order of the projections is the order autograd sums their gradients into
            # x's, so reordering them changes every run's losses in their last bits.
            q, k, v = rotated(self.wq, self.q_norm), rotated(self.wk, self.k_norm), heads(self.wv)
        else:
            if mask is None:
                raise ValueError("attention under context parallelism takes the mask of its queries (causal_mask)")
            k, v = rotated(self.wk, self.k_norm), heads(self.wv)
            # The keys and values are gathered while the queries are projected (`start_gather`).
            pending = cp.start_gather(torch.stack((k, v)), dim=2)
            q = rotated(self.wq, self.q_norm)
            k, v = cp.finish_gather(pending, dim=2).unbind(0)
        return self.wo(attend_cached(q, k, v, mask, kv))
