"""The mixture-of-experts feed-forward of the MoE families: a router, top-k experts, SwiGLU experts, and the
routing statistics their load balancing reads. Qwen3-MoE uses `MoE` as it is; DeepSeek-V3 changes its router
and adds shared experts (`models/deepseek_v3/moe.py`).

Routing follows Hugging Face's `Qwen3MoeSparseMoeBlock` (softmax in fp32, top-k combine weights renormalised
when `norm_topk_prob`); with `enable_routing_bias` a per-expert bias is added for choosing the experts only.
The (token, expert) pairs are sorted by expert and run as one grouped GEMM per weight (`torch._grouped_mm`),
or as a loop over the experts where grouped GEMM cannot run; `grouped_gemm_dtype` says where and in which
dtype (bf16 on CUDA 9.x and 10.x). The GEMMs go through an opaque op (`grouped_mm`) that compiled graphs do
not trace into, and a rank that received no rows calls no kernel. Each forward records its router statistics
(`RouterStats`) for the family's load-balancing loss (`moe_balance.py`) and accumulates `tokens_per_expert`
for the metrics.
Expert compute per device, measured: docs/moe.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.parallelisms.expert_parallel.unit import ExpertShard


def local(weight: torch.Tensor) -> torch.Tensor:
    """A weight as this rank computes with it: under tensor parallelism the MoE layer's weights are
    replicated over tp (`ReplicateWeights`, `tensor_parallel.moe_tp_block`) and the layer runs on the
    same tokens on every tp rank, so their local tensor is the whole weight and its gradient whole."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


@dataclass
class RouterStats:
    """One MoE layer's routing over the last microbatch: what the auxiliary loss needs."""

    counts: torch.Tensor
    """[experts] float: how many (token, slot) pairs chose each expert (no gradient)."""
    prob_sum: torch.Tensor
    """[experts] fp32: the router's softmax probability of each expert, summed over the tokens; with its
    autograd graph only where an auxiliary loss reads it (`MoE.aux_loss`)."""
    tokens: int


def grouped_gemm_dtype(*widths: int, dtype: torch.dtype, device: torch.device) -> torch.dtype | None:
    """The dtype the experts' grouped GEMMs run in on `device` for compute dtype `dtype` and rows of these
    widths, or None where the experts' loop runs instead (module docstring): bf16 on CUDA from compute
    capability 9.0 (Hopper) through 10.x (Blackwell), the loop on other GPUs; the compute dtype elsewhere.
    Rows must have byte strides that are multiples of 16 in that dtype."""
    if not hasattr(torch, "_grouped_mm"):
        return None
    if device.type == "cuda":
        if torch.cuda.get_device_capability(device)[0] not in (9, 10):
            return None
        dtype = torch.bfloat16
    return dtype if all(w * dtype.itemsize % 16 == 0 for w in widths) else None


def grouped_mm_shape(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> tuple[int, ...]:
    """The shape of `grouped_mm(a, b, offs)`."""
    if b.dim() == 3:
        return (a.shape[0], b.shape[-1])
    return (offs.shape[0], a.shape[0], b.shape[-1])


@torch.library.custom_op("titanlite::grouped_mm", mutates_args=())
def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`torch._grouped_mm` as an opaque op: a [M, K] x b [E, K, N] -> [M, N] (rows grouped by `offs`), or
    a [K, M] x b [M, N] -> [E, K, N] (the weight gradient, the shared dim grouped). Compiled graphs call
    it without tracing into it: torch's fake-tensor rule for `_grouped_mm` accepts bf16 only, which
    would break an fp32 graph that the CPU kernel runs. A rank that received no rows calls no kernel: an
    empty shared dim (the weight gradient) gives zeros, which CUDA's kernel rejects, and an empty output
    (the forward and the input gradient) has nothing to compute."""
    shape = grouped_mm_shape(a, b, offs)
    if a.shape[-1] == 0 or math.prod(shape) == 0:
        return a.new_zeros(shape)
    return torch._grouped_mm(a, b, offs=offs)


@grouped_mm.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return a.new_empty(grouped_mm_shape(a, b, offs))


def _grouped_mm_backward(ctx, grad: torch.Tensor):
    a, b, offs = ctx.saved_tensors
    grad = grad.contiguous()  # an expanded (zero-stride) gradient is rejected by the kernel
    return grouped_mm(grad, b.transpose(-2, -1), offs), grouped_mm(a.t(), grad, offs), None


def _grouped_mm_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


class Experts(nn.Module):
    """`num_experts` SwiGLU FFNs, stored as Hugging Face stores them: `gate_up_proj` [E, 2I, H] (gate rows
    then up rows), `down_proj` [E, H, I].

    Expert parallelism's seam (`parallelisms/expert_parallel/unit.py`): with `expert_parallel` set, the weights
    are DTensors sharded over the experts' dim, and the rows go to the ranks that hold their experts and
    back (`ExpertShard.run`); `compute` runs this rank's experts either way."""

    expert_parallel: ExpertShard | None = None

    def __init__(self, num_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.num_experts, self.hidden_dim = num_experts, hidden_dim
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor, grouped: bool) -> torch.Tensor:
        """x [rows, H] sorted by expert, `counts` [E] rows per expert -> [rows, H]."""
        weights = (self.gate_up_proj, self.down_proj)
        if self.expert_parallel is not None:
            return self.expert_parallel.run(partial(self.compute, grouped=grouped), x, counts, weights)
        return self.compute(x, counts, *map(local, weights), grouped=grouped)

    def compute(
        self, x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, grouped: bool
    ) -> torch.Tensor:
        """The experts of `gate_up` [e, 2I, H] and `down` [e, H, I] on x [rows, H] sorted by expert with
        `counts` [e] rows each."""
        widths = (x.shape[-1], 2 * self.hidden_dim, self.hidden_dim)
        gemm = grouped_gemm_dtype(*widths, dtype=x.dtype, device=x.device) if grouped else None
        if gemm is not None:
            offsets = torch.cumsum(counts, 0, dtype=torch.int32)
            rows, gate_up, down = x.to(gemm), gate_up.to(gemm), down.to(gemm)
            gate, up = grouped_mm(rows, gate_up.transpose(-2, -1), offsets).chunk(2, dim=-1)
            return grouped_mm((F.silu(gate) * up).contiguous(), down.transpose(-2, -1), offsets).to(x.dtype)
        outs = []
        # The loop needs the counts on the host: one sync per layer.
        for e, rows in enumerate(torch.split(x, counts.tolist(), dim=0)):
            gate, up = (rows @ gate_up[e].T).chunk(2, dim=-1)
            outs.append((F.silu(gate) * up) @ down[e].T)
        return torch.cat(outs, dim=0)


class MoE(nn.Module):
    """Router + experts: x [b, s, H] -> [b, s, H]; records `stats` and accumulates `tokens_per_expert`."""

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        grouped: bool,
        layer_id: int = 0,
        aux_loss: bool = True,
    ):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob, self.grouped = num_experts, top_k, norm_topk_prob, grouped
        self.layer_id = layer_id
        self.aux_loss = aux_loss
        """An auxiliary loss reads the router's probabilities: `stats.prob_sum` keeps its graph. Without one
        it is recorded without: the graph would keep the router's inputs (the block's norms and attention)
        alive until the loss, and under full activation checkpointing what their recompute saved."""
        """The decoder block's index: the metrics and the balancing bias line the layers up by it across
        pipeline stages."""
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = Experts(num_experts, dim, hidden_dim)
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts), persistent=False)
        self.register_buffer("expert_bias", None)
        self.register_buffer("step_tokens", None, persistent=False)
        self.stats: RouterStats | None = None

    def enable_routing_bias(self, count_steps: bool = True) -> None:
        """Aux-loss-free balancing: a per-expert bias added to the router's probabilities for choosing the
        experts only (the combine weights stay the probabilities), saved in checkpoints, and (`count_steps`)
        the step's token counts it is updated from (`moe_balance.update_routing_bias`); without them the bias
        routes but stays as loaded."""
        self.register_buffer("expert_bias", torch.zeros(self.num_experts))
        if count_steps:
            self.register_buffer("step_tokens", torch.zeros(self.num_experts), persistent=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> (probs [T, E] fp32, top-k weights [T, k] in x's dtype, top-k experts [T, k])."""
        probs = F.softmax(F.linear(x, local(self.gate.weight)), dim=-1, dtype=torch.float32)
        if self.expert_bias is None:
            weights, experts = torch.topk(probs, self.top_k, dim=-1)
        else:
            experts = torch.topk(probs + self.expert_bias, self.top_k, dim=-1).indices
            weights = probs.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs, weights, experts = self.route(x)
        flat = experts.flatten()
        # Counted with a fixed-size scatter (bincount's output size depends on the data: a graph break).
        counts = flat.new_zeros(self.num_experts).scatter_add_(0, flat, torch.ones_like(flat))
        if self.training:  # validation and generation are not part of the training's load
            with torch.no_grad():
                self.tokens_per_expert.add_(counts.to(self.tokens_per_expert.dtype))
                if self.step_tokens is not None:
                    self.step_tokens.add_(counts.to(self.step_tokens.dtype))
        prob_sum = probs.sum(dim=0) if self.aux_loss else probs.detach().sum(dim=0)
        self.stats = RouterStats(counts.detach().float(), prob_sum, x.shape[0])
        # (token, slot) pairs sorted by expert; a stable sort keeps the token order within an expert.
        order = torch.argsort(flat, stable=True)
        out = self.experts(x[order // self.top_k], counts, self.grouped)
        # Back to (token, slot) order, weighted and summed over the slots: a gather, no scatter-add, so
        # the combine is deterministic on every device.
        out = out[torch.argsort(order)].view(-1, self.top_k, shape[-1])
        return (out * weights[..., None]).sum(dim=1).reshape(shape)


def moe_layers(module: nn.Module) -> list[MoE]:
    """The MoE layers inside `module`: a model, a pipeline stage or a union of stages."""
    return [m for m in module.modules() if isinstance(m, MoE)]


def layer_stats(module: nn.Module) -> list[RouterStats]:
    """The routing of `module`'s MoE layers in their last forward (the layers that have run)."""
    return [m.stats for m in moe_layers(module) if m.stats is not None]


def routing_sums(stats: list[RouterStats], carried: torch.Tensor | None = None) -> torch.Tensor:
    """What the load-balancing loss needs of these layers' routing (and of the layers before them, the
    `carried` sums a pipeline's earlier stages handed on) as one tensor [3, E]: the counts, the router
    probabilities summed over the tokens, and the token rows (in every column), summed over the layers."""
    parts = [torch.stack([s.counts, s.prob_sum, torch.full_like(s.counts, s.tokens)]) for s in stats]
    if carried is not None:
        parts.append(carried)
    return torch.stack(parts).sum(0)


def aux_loss_of_sums(sums: torch.Tensor) -> torch.Tensor:
    """Hugging Face's `load_balancing_loss_func` of the `routing_sums` of every layer: E * sum_e f_e * P_e,
    with f_e the (token, slot) pairs routed to expert e per token and P_e its mean router probability,
    both over every layer's tokens together; top_k when the routing is uniform."""
    counts, prob_sum, rows = sums
    rows = rows.clamp_min(1)  # no MoE layer ran (a dense stage or model): no tokens, no loss
    return sums.shape[-1] * ((counts / rows) * (prob_sum / rows)).sum()
