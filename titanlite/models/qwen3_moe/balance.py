"""Qwen3-MoE's load balancing as the step sees it: the auxiliary loss term and the routing metrics.

`aux_loss_term(model)` is the family's `ModelSpec.extra_loss`: `router_aux_loss_coef` times Hugging
Face's load-balancing loss over the MoE layers of the forward that just ran (`moe.aux_loss`).

`routing_metrics(model)` is the family's `ModelSpec.step_metrics`, called by every rank at each log: the
tokens routed to each expert since the last log, summed over all ranks (one all-reduce), give the load
imbalance (max / mean tokens per expert, the worst MoE layer's); the auxiliary loss is the last
microbatch's (this rank's, unweighted). The counters are reset.

`update_routing_bias(model)` is the family's `ModelSpec.after_step` (aux-loss-free balancing, DeepSeek-V3):
after every optimizer step, the step's token counts per expert, summed over all ranks (one all-reduce
for every layer together), move each expert's routing bias by `router_bias_update_rate` towards the mean:
up where the expert got fewer tokens than the mean, down where more. Every rank computes the same bias.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from titanlite.models.qwen3_moe.moe import MoE, aux_loss


def _moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def aux_loss_term(model: nn.Module) -> torch.Tensor:
    layers = [m for m in _moe_layers(model) if m.stats is not None]
    if not layers:
        return torch.zeros((), device=next(model.parameters()).device)
    return model.args.router_aux_loss_coef * aux_loss([m.stats for m in layers], layers[0].num_experts)


@torch.no_grad()
def routing_metrics(model: nn.Module) -> dict[str, float]:
    layers = _moe_layers(model)
    if not layers:
        return {}
    counts = torch.stack([m.tokens_per_expert for m in layers])
    for m in layers:
        m.tokens_per_expert.zero_()
    if dist.is_initialized():
        dist.all_reduce(counts)
    imbalance = (counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-9)).max()
    stats = [m.stats for m in layers if m.stats is not None]
    aux = aux_loss(stats, layers[0].num_experts).item() if stats else float("nan")
    return {"moe_aux_loss": aux, "moe_load_imbalance": imbalance.item()}


@torch.no_grad()
def update_routing_bias(model: nn.Module) -> None:
    layers = [m for m in _moe_layers(model) if m.expert_bias is not None]
    if not layers:
        return
    counts = torch.stack([m.step_tokens for m in layers])
    if dist.is_initialized():
        dist.all_reduce(counts)
    step = model.args.router_bias_update_rate * torch.sign(counts.mean(dim=1, keepdim=True) - counts)
    for m, delta in zip(layers, step):
        m.expert_bias.add_(delta)
        m.step_tokens.zero_()
