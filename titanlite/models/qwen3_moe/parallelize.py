"""Qwen3-MoE's tensor-parallel styles: the dense decoder's for the dense parts, the MoE layer on gathered
tokens.

Attention, the dense FFN layers, the embedding, norms and output split as dense Qwen3's (Megatron-style
TP with sequence parallelism, the per-head q/k RMSNorms on each rank's own heads;
`models/common/tensor_parallel.py`). A MoE layer is not split: its input's sequence shards are
gathered, every tp rank routes the same tokens with the same (replicated) router and experts, and the
output is split back into sequence shards. So the experts' weights and gradients are whole and equal on
every tp rank, expert parallelism (which splits them over the data-parallel shard ranks) needs nothing of
tp, and the router's auxiliary loss sees the whole microbatch as in one process. The price is the MoE
layer's compute done tp times; splitting the experts' tokens over tp is not done.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInputOutput

from titanlite.models.common.tensor_parallel import dense_tp_styles
from titanlite.parallelisms.data_parallel.replicate_weights import ReplicateWeights
from titanlite.parallelisms.tensor_parallel.unit import TensorParallelStyles


def qwen3_moe_tp_styles(loss_parallel: bool) -> TensorParallelStyles:
    dense = dense_tp_styles(loss_parallel, qk_norm=True)
    return TensorParallelStyles(
        roots=dense.roots,
        block={
            **dense.block,  # the attention, its norms, ffn_norm and the dense layers' feed_forward
            "moe": PrepareModuleInputOutput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(Shard(1),),
                use_local_output=True,
            ),
            "moe.gate": ReplicateWeights(),
            "moe.experts": ReplicateWeights(),
        },
    )
