"""The MoE families' load balancing as the step sees it: the auxiliary loss term, the routing metrics, the
balancing bias's update and the layouts it refuses.

`aux_loss_term(model)` (`hooks.extra_loss`): `router_aux_loss_coef` times Hugging Face's load-balancing loss
over the MoE layers of the forward that just ran, with the routing sums earlier pipeline stages handed on.
`routing_metrics(model)` (`hooks.step_metrics`, every rank at each log): the load imbalance (max / mean
tokens per expert, the worst layer's) and the pooled auxiliary loss; the counters are reset.
`update_routing_bias(model)` (`hooks.after_step`, aux-loss-free balancing as DeepSeek-V3): moves each expert's
routing bias by `router_bias_update_rate` towards the mean load. Both sum over the world in one all-reduce of a
tensor with a row per layer, each rank filling the layers it holds. `check_layout` (`shape.check_layout`):
the bias refuses pipeline stages. The metrics and the bias: docs/moe.md.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titanlite.models.common.moe import aux_loss_of_sums, layer_stats, moe_layers, routing_sums
from titanlite.parallelisms.parallel_dims import ParallelDims


def aux_loss_term(model: nn.Module) -> torch.Tensor:
    carried = getattr(model, "routing_in", None)
    stats = layer_stats(model)
    if not stats and carried is None:
        return torch.zeros((), device=next(model.parameters()).device)
    return model.args.router_aux_loss_coef * aux_loss_of_sums(routing_sums(stats, carried))


def _summed_by_layer(model: nn.Module, rows: dict[int, torch.Tensor], width: int) -> torch.Tensor:
    """[n_layers, width]: each held layer's row, zeros for the others, summed over the world."""
    device = next(model.parameters()).device
    out = torch.zeros(model.args.n_layers, width, device=device)
    for layer, row in rows.items():
        out[layer] = row
    if dist.is_initialized():
        dist.all_reduce(out)
    return out


@torch.no_grad()
def routing_metrics(model: nn.Module) -> dict[str, float]:
    args = model.args
    if not args.moe_layers:
        return {}
    experts, rows = args.num_experts, {}
    for m in moe_layers(model):
        last = routing_sums([m.stats]) if m.stats is not None else m.tokens_per_expert.new_zeros(3, experts)
        rows[m.layer_id] = torch.cat([m.tokens_per_expert, last.flatten()])
        m.tokens_per_expert.zero_()
    summed = _summed_by_layer(model, rows, 4 * experts)
    counts, last = summed[:, :experts], summed[:, experts:].reshape(-1, 3, experts).sum(0)
    imbalance = (counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-9)).max()
    aux = aux_loss_of_sums(last).item() if last[2, 0] > 0 else float("nan")
    return {"moe_aux_loss": aux, "moe_load_imbalance": imbalance.item()}


@torch.no_grad()
def update_routing_bias(model: nn.Module) -> None:
    if model.args.router_bias_update_rate <= 0:
        return
    layers = [m for m in moe_layers(model) if m.expert_bias is not None]
    counts = _summed_by_layer(model, {m.layer_id: m.step_tokens for m in layers}, model.args.num_experts)
    step = model.args.router_bias_update_rate * torch.sign(counts.mean(dim=1, keepdim=True) - counts)
    for m in layers:
        m.expert_bias.add_(step[m.layer_id])
        m.step_tokens.zero_()


def check_layout(args: Any, dims: ParallelDims) -> str | None:
    """Aux-loss-free balancing counts the tokens of every training forward. Under pipeline parallelism
    torch's stages run one forward more on their first step, to infer the shapes they exchange (on the
    first microbatch, or on uninitialised hidden states), whose tokens would move the routing bias. `args`:
    the family's ModelArgs."""
    if dims.pp > 1 and args.router_bias_update_rate > 0:
        return (
            "aux-loss-free balancing (model.router_bias_update_rate > 0) does not combine with "
            "pipeline_parallel_degree > 1: the pipeline stages' first forward, run to infer shapes, would count "
            "tokens that are not trained on"
        )
    return None
