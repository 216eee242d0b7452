"""The RoPE rows and the attention mask of one decoder forward: the rule the shared decoder follows
(`decoder.Decoder.hidden_states`), so that generation, packed documents and context-parallel pipeline
stages mean the same in every family.

- with a KV cache (generation): the rows of the positions the new tokens take (`KVCache.check`), no mask;
- with per-document `positions`: the rows of those positions (the family's `at`), the batch's mask;
- under context parallelism without a mask (a pipeline stage, whose rows are `seq_len` tokens: its hidden
  states may arrive sequence-sharded under TP, so their length is not the rank's share of the row): the
  rows of this rank's tokens and the causal mask of their queries against every key, built once per
  microbatch as the step builds it without stages (`attention.causal_mask`);
- otherwise the tables as they are, with the batch's mask.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from titanlite.models.common.attention import Mask, causal_mask
from titanlite.models.common.kv_cache import KVCache
from titanlite.parallelisms.context_parallel.unit import SequenceShard

Rope = tuple[torch.Tensor, torch.Tensor]


def rope_rows(
    tables: Rope,
    h: torch.Tensor,
    n_tokens: int,
    *,
    cache: KVCache | None,
    positions: torch.Tensor | None,
    mask: Mask,
    cp: SequenceShard | None,
    seq_len: int,
    at: Callable[[torch.Tensor], Rope],
) -> tuple[torch.Tensor, torch.Tensor, Mask, int]:
    """(cos, sin, mask, the cache position the tokens start at) for a forward of `n_tokens` tokens whose
    hidden states are `h`, from the model's RoPE `tables`."""
    cos, sin = tables
    if cache is not None:
        if positions is not None or mask is not None:
            raise ValueError("generation with a KV cache is causal over one sequence: no positions or mask")
        pos = cache.check(n_tokens)
        return cos[pos : pos + n_tokens], sin[pos : pos + n_tokens], None, pos
    if positions is not None:
        return *at(positions), mask, 0
    if cp is not None and mask is None:
        held = cp.held_positions(seq_len, h.device)
        return cos[held], sin[held], causal_mask(h.shape[0], seq_len, held), 0
    return cos, sin, mask, 0
