"""DeepSeek-V3's load balancing as the step sees it: the bias update after each optimizer step and the
routing metrics at each log.

`update_routing_bias` (`hooks.after_step`) is the MoE families' (`models/common/moe_balance.py`): every
rank, one all-reduce of the step's tokens per expert over the world, then bias += rate * sign(mean load - load)
per layer. `routing_metrics` (`hooks.step_metrics`) adds to their expert load imbalance and pooled auxiliary
loss the spread of the balancing bias (max - min over the experts, the worst layer, all ranks: one all-reduce of
the maximum). Both in docs/deepseek_v3.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from titanlite.models.common.moe import moe_layers
from titanlite.models.common.moe_balance import aux_loss_term, update_routing_bias
from titanlite.models.common.moe_balance import routing_metrics as expert_load_metrics

__all__ = ["aux_loss_term", "routing_metrics", "update_routing_bias"]


@torch.no_grad()
def bias_spread(model: nn.Module) -> float:
    """max - min of each MoE layer's balancing bias, the largest over the layers of every rank."""
    device = next(model.parameters()).device
    spread = torch.zeros((), device=device)
    for m in moe_layers(model):
        if m.expert_bias is not None:
            spread = torch.maximum(spread, m.expert_bias.max() - m.expert_bias.min())
    if dist.is_initialized():
        dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    return spread.item()


def routing_metrics(model: nn.Module) -> dict[str, float]:
    if not model.args.moe_layers:
        return {}
    return {**expert_load_metrics(model), "moe_bias_spread": bias_spread(model)}
