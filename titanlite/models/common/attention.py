"""Attention masks for packed sequences: which key each query may attend, built once per batch.

`causal` lets every token attend every earlier token of the sequence (no mask tensor); `block_causal` only
the earlier tokens of its own document. Documents come from positions (0 at a document's first token,
`titanlite/data/batch.py`): `document_ids` numbers a row's documents from the whole row, before any sharding,
and `allowed(doc_ids, b, i, j)` takes GLOBAL indices, so a context-parallel rank holding some queries and every
key builds its rows of the mask from the same function (`build_mask`'s `q_index` and `kv_index`). On CUDA the
mask is a flex-attention `BlockMask` shared by every block; elsewhere a dense boolean mask for
`scaled_dot_product_attention` (flex attention has no backward on CPU). Both are built outside the blocks, so
compiled blocks never recompile for it and AC recomputes none of it; `mask_bytes` is their memory.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

AttnMaskType = Literal["causal", "block_causal"]
"""`model.attn_mask_type` (`titanlite/config/schema.py`)."""

Mask = torch.Tensor | BlockMask | None
"""A batch's mask: None (causal, the kernel's own), a dense boolean tensor, or a flex `BlockMask`."""

FLEX_BLOCK = 128
"""The BlockMask tile (flex attention's default): one block count per 128 queries, one index per tile."""


def uses_flex(device_type: str) -> bool:
    """Whether masks on this device type are flex BlockMasks (CUDA), else dense (module docstring)."""
    return device_type == "cuda"


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """[b, s] document numbers of each token from its [b, s] positions in its document: a new document
    begins where the position is 0 (a row's first tokens may continue a document begun in an earlier
    sample: they form document 0 of the row)."""
    return (positions == 0).cumsum(-1, dtype=torch.int32)


def allowed(doc_ids: torch.Tensor, b: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    """Whether query `q_idx` of row `b` may attend key `kv_idx` (global indices, broadcastable tensors):
    not later than the query, and in its document. The one definition both kernels evaluate."""
    return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])


def mask_mod(doc_ids: torch.Tensor, q_index: torch.Tensor, kv_index: torch.Tensor) -> Callable:
    """Flex attention's mask_mod over local score indices: they map to global ones through `q_index`
    and `kv_index` (module docstring)."""

    def mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return allowed(doc_ids, b, q_index[q], kv_index[kv])

    return mod


def dense_mask(doc_ids: torch.Tensor, q_index: torch.Tensor, kv_index: torch.Tensor) -> torch.Tensor:
    """[b, 1, q, kv] boolean mask (True = attend) for scaled_dot_product_attention."""
    b = torch.arange(doc_ids.shape[0], device=doc_ids.device)[:, None, None]
    return allowed(doc_ids, b, q_index[None, :, None], kv_index[None, None, :]).unsqueeze(1)


def build_mask(
    mask_type: AttnMaskType,
    positions: torch.Tensor | None,
    q_index: torch.Tensor | None = None,
    kv_index: torch.Tensor | None = None,
) -> Mask:
    """The mask of one batch, on `positions`' device, once for every block: None under `causal`; under
    `block_causal` a BlockMask on CUDA, a dense mask elsewhere. `positions` [b, s] cover the whole rows;
    `q_index`/`kv_index` (default every index) are the global indices of this rank's queries and keys."""
    if mask_type == "causal":
        return None
    if positions is None:
        raise ValueError("attn_mask_type block_causal needs the batch's positions")
    device, seq = positions.device, positions.shape[-1]
    doc_ids = document_ids(positions)
    q_index = torch.arange(seq, device=device) if q_index is None else q_index
    kv_index = torch.arange(seq, device=device) if kv_index is None else kv_index
    if uses_flex(device.type):
        return block_mask(doc_ids, q_index, kv_index)
    return dense_mask(doc_ids, q_index, kv_index)


def causal_mask(rows: int, seq: int, q_index: torch.Tensor) -> Mask:
    """The causal mask of the queries at global indices `q_index` against every key of `rows` rows of
    `seq` tokens, each row one document: `build_mask`'s (a BlockMask on CUDA, dense elsewhere), never
    `scaled_dot_product_attention` with a dense mask on CUDA, which with grouped-query heads runs its
    math kernel and materialises every score. What context parallelism's ranks attend under `causal`
    (their queries are not a prefix of the keys, so the kernel's own causal flag cannot say it)."""
    positions = torch.arange(seq, device=q_index.device).expand(rows, seq)
    return build_mask("block_causal", positions, q_index=q_index)


def block_mask(doc_ids: torch.Tensor, q_index: torch.Tensor, kv_index: torch.Tensor) -> BlockMask:
    """flex attention's BlockMask over `allowed`, on `doc_ids`' device. Its construction is compiled:
    uncompiled it evaluates the mask_mod over the whole batch x q x kv score matrix at once."""
    mod = mask_mod(doc_ids, q_index, kv_index)
    create = compiled_flex()[1]
    return create(mod, doc_ids.shape[0], None, len(q_index), len(kv_index), device=doc_ids.device)


@functools.cache
def compiled_flex() -> tuple[Callable, Callable]:
    """(flex_attention, create_block_mask), each compiled once per process (uncompiled, flex attention runs
    an unfused reference that materialises every score). A new batch's mask_mod closes over new tensors of
    the same shapes: it reuses the compiled code. The mask's construction is compiled for static shapes
    (a run has one or two: training and validation batches), never a dynamic-shape variant."""
    return torch.compile(flex_attention), torch.compile(create_block_mask, dynamic=False)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, causal: bool = True, scale: float | None = None
) -> torch.Tensor:
    """Attention of q [b, h, sq, d] over k, v [b, kv_heads, skv, d] (grouped-query heads broadcast) under
    the batch's `mask`; with no mask, causal when `causal` (from the first key), else every key. `scale`:
    the softmax scale, None for 1 / sqrt(d)."""
    gqa = k.shape[1] != q.shape[1]
    if isinstance(mask, BlockMask):
        return compiled_flex()[0](q, k, v, block_mask=mask, enable_gqa=gqa, scale=scale)
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa, scale=scale)


def mask_bytes(mask_type: AttnMaskType, device_type: str, batch: int, q_len: int, kv_len: int) -> int:
    """Bytes of one batch's mask (`build_mask`): none for causal; a dense [b, 1, q, kv] bool, or on CUDA a
    BlockMask's int32 block counts and indices, for both partial and full tiles and both orientations
    (the transposed ones drive the backward)."""
    if mask_type == "causal":
        return 0
    if not uses_flex(device_type):
        return batch * q_len * kv_len
    qb, kb = math.ceil(q_len / FLEX_BLOCK), math.ceil(kv_len / FLEX_BLOCK)
    per_kind = qb + qb * kb + kb + kb * qb  # kv counts + indices, q counts + indices
    return 2 * 4 * batch * per_kind
