"""Qwen3-MoE's tensor-parallel styles: the dense decoder's for the dense parts, the MoE layer on gathered
tokens.

Attention, the dense FFN layers, the embedding, norms and output split as dense Qwen3's (Megatron-style
TP with sequence parallelism, the per-head q/k RMSNorms on each rank's own heads); a MoE layer is not split,
its router and experts replicated over tp on the gathered tokens (both: `models/common/tensor_parallel.py`).
"""

from __future__ import annotations

from titanlite.models.common.tensor_parallel import dense_tp_styles, moe_tp_block
from titanlite.parallelisms.tensor_parallel.unit import TensorParallelStyles


def qwen3_moe_tp_styles(loss_parallel: bool) -> TensorParallelStyles:
    dense = dense_tp_styles(loss_parallel, qk_norm=True)
    # The attention, its norms, ffn_norm and the dense layers' feed_forward; then the MoE layer.
    return TensorParallelStyles(roots=dense.roots, block={**dense.block, **moe_tp_block()})
