"""DeepSeekMoE: routed experts chosen by a biased, group-limited router, plus shared experts every token uses.

Routing (Hugging Face's `DeepseekV3TopkRouter`): scores = sigmoid (or softmax) of the router's logits, in
fp32; for choosing, each expert's `expert_bias` is added (aux-loss-free balancing,
`models/common/moe_balance.py`); with `n_group` > 1 the experts are cut into groups and only the `topk_group`
groups whose two best biased scores sum highest stay eligible; the `top_k` best eligible experts are taken.
Their combine weights are the unbiased scores, divided by their sum when `norm_topk_prob`, times
`routed_scaling_factor`. The output is the routed experts' weighted sum plus `shared_experts(x)`, one SwiGLU
`n_shared_experts` x `moe_ffn_dim` wide.

The dispatch, the experts (stacked weights, grouped GEMMs, expert parallelism's seam) and the routing
statistics are the MoE families' (`models/common/moe.py`): this layer changes the router and adds the shared
experts. The statistics' probabilities are the scores normalised over the experts (a sigmoid's do not sum
to 1), which the optional auxiliary loss pools.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from titanlite.models.common.feed_forward import FeedForward
from titanlite.models.common.moe import MoE, local

ScoreFunc = Literal["sigmoid", "softmax"]


class DeepSeekMoE(MoE):
    """Router + routed experts + shared experts: x [b, s, H] -> [b, s, H] (module docstring). The
    balancing bias is always a buffer (published checkpoints carry it); it moves during training only with
    `count_steps` (`router_bias_update_rate` > 0)."""

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        *,
        n_shared_experts: int,
        score_func: ScoreFunc,
        n_group: int,
        topk_group: int,
        routed_scaling_factor: float,
        norm_topk_prob: bool,
        grouped: bool,
        count_steps: bool,
        layer_id: int = 0,
        aux_loss: bool = True,
    ):
        super().__init__(dim, hidden_dim, num_experts, top_k, norm_topk_prob, grouped, layer_id, aux_loss)
        self.score_func, self.n_group, self.topk_group = score_func, n_group, topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.enable_routing_bias(count_steps)
        self.shared_experts = FeedForward(dim, n_shared_experts * hidden_dim) if n_shared_experts else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> (scores normalised over the experts [T, E] fp32, combine weights [T, k] in x's dtype,
        chosen experts [T, k])."""
        logits = F.linear(x.float(), local(self.gate.weight).float())
        scores = logits.sigmoid() if self.score_func == "sigmoid" else logits.softmax(dim=-1)
        choice = scores + self.expert_bias
        if self.n_group > 1:
            grouped = choice.unflatten(-1, (self.n_group, -1))
            best = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, groups]
            kept = torch.zeros_like(best, dtype=torch.bool).scatter_(-1, best.topk(self.topk_group, -1).indices, True)
            choice = grouped.masked_fill(~kept[..., None], float("-inf")).flatten(-2)
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * self.routed_scaling_factor
        probs = scores / scores.sum(dim=-1, keepdim=True) if self.score_func == "sigmoid" else scores
        return probs, weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out + self.shared_experts(x) if self.shared_experts is not None else out
