"""Multi-head latent attention (DeepSeek-V2/V3): keys and values come from one small latent per token.

x -> `wkv_a` -> [latent (kv_lora_rank) | k_rope (qk_rope_head_dim)]; the latent is normalised (`kv_norm`)
and expanded by `wkv_b` into every head's key part without RoPE (qk_nope_head_dim) and value (v_head_dim);
the key's rotary part is one head shared by all heads. Queries come from `wq` (q_lora_rank 0) or through a
latent of their own (`wq_a`, `q_norm`, `wq_b`); each query head is [nope | rope], RoPE turning the rope part
only (`rope.py`). Scores use the softmax scale qk_head_dim^-1/2 (times YaRN's mscale^2).

Same call as the grouped-query attention, (x, cos, sin, mask[, kv]), so it plugs into the shared block.
Under context parallelism the keys (nope and rope) and values of the whole sequence are gathered through
the `context_parallel` seam, as `GroupedQueryAttention` does. The KV cache holds the expanded keys and
values (keys qk_head_dim wide, values v_head_dim). Tensor-parallel sharding: `parallelize.py`.
"""

from __future__ import annotations

import torch
from torch import nn

from titanlite.models.common.attention import Mask
from titanlite.models.common.grouped_query_attention import Rotate
from titanlite.models.common.kv_cache import LayerKV, attend_cached
from titanlite.models.common.norm import RMSNorm
from titanlite.parallelisms.context_parallel.unit import SequenceShard
from titanlite.parallelisms.tensor_parallel.partial_grad import head_local


class MultiHeadLatentAttention(nn.Module):
    context_parallel: SequenceShard | None = None
    """Under context parallelism this rank's part of every sequence (set by the framework): the keys and
    values of all are gathered, the mask is that of the rank's queries (`GroupedQueryAttention`'s)."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        q_lora_rank: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        rotate: Rotate,
        softmax_scale: float,
        norm_eps: float,
    ):
        super().__init__()
        self.kv_lora_rank, self.nope, self.rope, self.v_head_dim = (
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
        )
        self.rotate, self.softmax_scale = rotate, softmax_scale
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank == 0:
            self.wq = nn.Linear(dim, n_heads * qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_norm = RMSNorm(q_lora_rank, norm_eps)
            self.wq_b = nn.Linear(q_lora_rank, n_heads * qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(kv_lora_rank, norm_eps)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [b, s, dim] -> q [b, s, heads, qk_head_dim], the rope part rotated. Under tensor parallelism
        `wq`/`wq_b` hold a slice of the heads: the local count is inferred."""
        q = self.wq(x) if hasattr(self, "wq") else self.wq_b(self.q_norm(self.wq_a(x)))
        q_nope, q_rope = q.view(*x.shape[:2], -1, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        return torch.cat((q_nope, self.rotate(q_rope, cos, sin)), dim=-1)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [b, s, dim] -> [b, s, heads, qk_head_dim + v_head_dim]: each head's key (nope, then the shared
        rotated rope part) and value, side by side (one tensor for the context-parallel gather)."""
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope], dim=-1)
        # One head every head shares: under tensor parallelism each rank's heads give part of its gradient.
        k_rope = self.rotate(head_local(k_rope).unsqueeze(2), cos, sin)
        kv = self.wkv_b(self.kv_norm(latent)).view(*x.shape[:2], -1, self.nope + self.v_head_dim)
        k_nope, v = kv.split([self.nope, self.v_head_dim], dim=-1)
        return torch.cat((k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1), v), dim=-1)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Mask = None, kv: LayerKV | None = None
    ) -> torch.Tensor:
        cp = self.context_parallel if kv is None else None
        if cp is None:
            q, kv_heads = self.queries(x, cos, sin), self.keys_values(x, cos, sin)
        else:
            if mask is None:
                raise ValueError("attention under context parallelism takes the mask of its queries (causal_mask)")
            # The keys and values are gathered over the sequence while the queries are projected.
            pending = cp.start_gather(self.keys_values(x, cos, sin), dim=1)
            q = self.queries(x, cos, sin)
            kv_heads = cp.finish_gather(pending, dim=1)
        k, v = kv_heads.split([self.nope + self.rope, self.v_head_dim], dim=-1)
        return self.wo(attend_cached(q, k, v, mask, kv, self.softmax_scale))
