"""Grouped-query attention with QK-norm, as both Qwen3 families build it: RMSNorm over each head's queries
and keys before RoPE in Hugging Face's halves layout (`rope_halves.py`), a head width of its own
(`head_dim`, not dim / n_heads), no biases.

Its parameters are `wq`, `wk`, `wv`, `wo`, `q_norm`, `k_norm`: TorchTitan's attention names plus the
norms, which the dense tensor-parallel plan (`tensor_parallel.py`) and each family's HF adapter address."""

from __future__ import annotations

import torch
from torch import nn

from titanlite.models.common.attention import Mask
from titanlite.models.common.kv_cache import LayerKV, attend_cached
from titanlite.models.common.norm import RMSNorm
from titanlite.models.common.rope_halves import apply_rope
from titanlite.parallelisms.context_parallel.unit import SequenceShard


class QKNormAttention(nn.Module):
    context_parallel: SequenceShard | None = None
    """The context-parallel seam, as on Llama 3's attention (`models/llama3/model.py`): this rank's part
    of every sequence, set by the framework where the family allows context parallelism."""

    def __init__(self, dim: int, n_heads: int, kv_heads: int, head_dim: int, norm_eps: float):
        super().__init__()
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.q_norm = RMSNorm(head_dim, norm_eps)
        self.k_norm = RMSNorm(head_dim, norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Mask = None, kv: LayerKV | None = None
    ) -> torch.Tensor:
        bsz, seq, _ = x.shape

        def heads(w: nn.Linear, norm: RMSNorm | None = None) -> torch.Tensor:
            # Under tensor parallelism the projections hold a slice of the heads: infer the local count.
            h = w(x).view(bsz, seq, -1, self.head_dim)
            return apply_rope(norm(h), cos, sin) if norm is not None else h

        cp = self.context_parallel if kv is None else None
        if cp is None:
            # Queries first, as Llama's: the order autograd sums the projections' gradients into x's.
            q, k, v = heads(self.wq, self.q_norm), heads(self.wk, self.k_norm), heads(self.wv)
        else:
            if mask is None:
                raise ValueError("attention under context parallelism takes the mask of its queries (causal_mask)")
            k, v = heads(self.wk, self.k_norm), heads(self.wv)
            # The keys and values are gathered while the queries are projected.
            pending = cp.start_gather(torch.stack((k, v)), dim=2)
            q = heads(self.wq, self.q_norm)
            k, v = cp.finish_gather(pending, dim=2).unbind(0)
        return self.wo(attend_cached(q, k, v, mask, kv))
