"""Expert parallelism: the ranks of the `ep` mesh dim each hold num_experts / ep of every MoE layer's experts.

The ep ranks are borrowed from the data-parallel shard ranks (dp_shard x cp, `ParallelDims.ep_mesh`). Every
ep rank routes its own tokens; `ExpertShard.run` exchanges the per-expert counts (the layer's one host sync per
forward, replayed rather than repeated in a checkpoint's recompute), sends each (token, expert) row to its
expert's rank with a differentiable all-to-all, runs the local experts and sends the results back. The
weights' gradient is scaled by 1 / ep, so after the data-parallel average over efsdp it is the mean over every
data-parallel rank, as one process computes it. Each expert weight is a DTensor of the full shape, Shard(0)
over `ep`, so checkpoints and the Hugging Face export see whole tensors. The model sees only the seam: a module
with an `expert_parallel` attribute gets this rank's `ExpertShard` there. Dispatch in detail: docs/moe.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titanlite.config import JobConfig
from titanlite.errors import ConfigError
from titanlite.parallelisms.host_replay import HostReplay
from titanlite.parallelisms.parallel_dims import ParallelDims
from titanlite.parallelisms.parallelism import ApplyArgs, ParallelismUnit, StageWork, when_on

if TYPE_CHECKING:
    from titanlite.parallelisms.data_parallel.simple_fsdp import DataParallelMesh

SEAM = "expert_parallel"
"""The attribute a module declares (None) to receive the rank's `ExpertShard`."""

ExpertCompute = Callable[..., torch.Tensor]
"""(rows sorted by local expert, counts per local expert, *local weights) -> the rows' outputs."""


class _ScaleGrad(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


@dataclass(frozen=True)
class Routing:
    """Where the rows of one dispatch went: what the combine needs to bring them back."""

    send_splits: list[int]
    """Rows this rank sent to each ep rank."""
    recv_splits: list[int]
    """Rows this rank received from each ep rank."""
    order: torch.Tensor
    """The received rows' indices in (local expert, source rank) order."""
    local_counts: torch.Tensor
    """[num_experts / ep] rows per local expert."""


def block_order(lengths: torch.Tensor, total: int) -> torch.Tensor:
    """Indices that reorder rows laid out in blocks of `lengths` [a, b] (row-major: block (i, j) after
    (i, j-1)) into column-major block order ((0, j), (1, j), ... before (0, j+1)); `total` is the sum of
    `lengths`, known on the host (without it `repeat_interleave` reads its output length from the device)."""
    flat = lengths.flatten()
    starts = (torch.cumsum(flat, 0) - flat).view_as(lengths)
    t_lengths, t_starts = lengths.t().flatten(), starts.t().flatten()
    first = torch.repeat_interleave(t_starts, t_lengths, output_size=total)
    within = torch.arange(total, device=first.device) - torch.repeat_interleave(
        torch.cumsum(t_lengths, 0) - t_lengths, t_lengths, output_size=total
    )
    return first + within


@dataclass(frozen=True)
class ExpertShard:
    """This rank's part of every MoE layer's experts and its ep group: what the model's experts call."""

    degree: int
    rank: int
    group_name: str
    """The ep process group, by name (functional collectives take it so)."""
    replay: HostReplay = field(default_factory=HostReplay, compare=False)
    """The row splits read in a checkpointed forward, handed back to its recompute (step 1 above)."""

    def __post_init__(self) -> None:
        # `run` is eager inside compiled blocks (`_run`). Disabled here, when a rank builds its shard, not
        # by a decorator when this module is imported: torch.compiler.disable imports the compiler, and the
        # launcher's run plan imports this module for its rules, before any rank (a second per launch).
        object.__setattr__(self, "run", torch.compiler.disable(self._run))

    @classmethod
    def of(cls, ep_mesh: DeviceMesh, replay: HostReplay | None = None) -> ExpertShard:
        group_name = ep_mesh.get_group().group_name
        return cls(ep_mesh.size(), ep_mesh.get_local_rank(), group_name, replay if replay is not None else HostReplay())

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        """`rows` [n, H] sorted by global expert with `counts` [E] per expert -> the rows of this rank's
        experts from every ep rank, sorted by local expert, and their routing."""
        with torch.no_grad():
            sent = counts.to(torch.int64)
            received = funcol.wait_tensor(funcol.all_to_all_single(sent, None, None, self.group_name))
            # [sent, received] x [ep rank] x [local expert]: both splits in one host read.
            exchanged = torch.stack((sent, received)).view(2, self.degree, -1)
            recorded, (send_splits, recv_splits) = self.replay.read(lambda: (exchanged, exchanged.sum(2).tolist()))
            if recorded is not exchanged:  # a recompute: its exchange must be the forward's
                torch._assert_async((recorded == exchanged).all(), "a recompute routed differently")
            order = block_order(exchanged[1], sum(recv_splits))
            local_counts = exchanged[1].sum(0)
        arrived = funcol.all_to_all_single_autograd(rows.contiguous(), recv_splits, send_splits, self.group_name)
        return arrived[order], Routing(send_splits, recv_splits, order, local_counts)

    def combine(self, out: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The inverse of `dispatch`: `out` [received rows, H] sorted by local expert -> each row back on
        the rank and at the position it was sent from."""
        with torch.no_grad():
            back = torch.empty_like(routing.order)
            back[routing.order] = torch.arange(routing.order.numel(), device=back.device)
        return funcol.all_to_all_single_autograd(
            out[back].contiguous(), routing.send_splits, routing.recv_splits, self.group_name
        )

    def local_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's experts of `weight` (a DTensor sharded over ep) as a plain tensor, its gradient
        scaled by 1 / ep (module docstring: the data-parallel plan then averages it over the rest)."""
        from torch.distributed.tensor import DTensor

        local = weight.to_local() if isinstance(weight, DTensor) else weight
        return _ScaleGrad.apply(local, 1.0 / self.degree)

    def _run(
        self, compute: ExpertCompute, rows: torch.Tensor, counts: torch.Tensor, weights: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """Dispatch `rows` (sorted by global expert, `counts` per expert), run `compute` on this rank's
        experts with their local `weights`, and combine: the rows' outputs in `rows`' order.

        Eager inside a compiled block (one graph break per MoE layer): the all-to-all's row splits are
        read on the host, and the local experts' row count changes every step, so a graph traced here
        would hold them as constants and recompile each step. The router before it and the weighting
        after it stay in the block's graphs; the weights arrive gathered by those graphs."""
        arrived, routing = self.dispatch(rows, counts)
        out = compute(arrived, routing.local_counts, *(self.local_weight(w) for w in weights))
        return self.combine(out, routing)


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` that declare the seam (`SEAM`)."""
    return [module for module in model.modules() if hasattr(type(module), SEAM)]


def dispatches(module: nn.Module) -> bool:
    """Whether `module` holds experts that expert parallelism has split (their tokens go to other ranks)."""
    return any(getattr(m, SEAM) is not None for m in expert_modules(module))


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, replay: HostReplay | None = None) -> list[nn.Module]:
    """Shard every seam module's parameters Shard(0) (the expert dim) over `ep_mesh` and give it this
    rank's `ExpertShard` (its row splits replayed by `replay` in checkpoint recomputes); returns those
    modules (the data-parallel plan places them on the experts' mesh)."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    shard = ExpertShard.of(ep_mesh, replay)
    modules = expert_modules(model)
    assert modules, "RunPlan.build refuses expert parallelism for a family without the seam"
    for module in modules:
        for name, param in list(module.named_parameters(recurse=False)):
            # Under TP the experts are whole on every tp rank (Replicate): their local tensor is split.
            whole = param.data.to_local() if isinstance(param.data, DTensor) else param.data
            placed = distribute_tensor(whole, ep_mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(placed, requires_grad=param.requires_grad))
        setattr(module, SEAM, shard)
    return modules


def check_expert_parallel(cfg: JobConfig, dims: ParallelDims, spec: Any, args: Any) -> None:
    """What expert parallelism needs beyond the mesh's own rule (ep divides dp_shard x cp, no PP:
    `ParallelDims`): a family whose experts declare the seam, experts that divide evenly over the ep ranks,
    SimpleFSDP, and no model-wide graph (the dispatch runs eager between graphs)."""
    ep, p = dims.ep, cfg.parallelism
    if spec.parallel.num_experts is None:
        raise ConfigError(f"model {spec.name} has no experts to split: set expert_parallel_degree 1")
    if (experts := spec.parallel.num_experts(args)) % ep:
        raise ConfigError(f"parallelism.expert_parallel_degree {ep} does not divide the model's {experts} experts")
    if p.dp_impl != "simple_fsdp":
        raise ConfigError(f"parallelism.expert_parallel_degree {ep} needs dp_impl simple_fsdp (got {p.dp_impl})")
    if cfg.compile.enable and cfg.compile.scope == "model":
        raise ConfigError(
            f"compile.scope=model with expert_parallel_degree {ep}: the token dispatch runs eager between "
            "graphs (a break per MoE layer), which one model-wide graph cannot have; use scope block or auto"
        )


def _apply(a: ApplyArgs) -> dict[nn.Module, DataParallelMesh]:
    """After TP and CP, before AC (whose recompute replays the row splits, `a.replay`) and data parallelism,
    which shards each rank's experts further over efsdp on the experts' own mesh."""
    assert a.dims.ep_mesh is not None and a.dims.expert_param_mesh is not None
    from titanlite.parallelisms.data_parallel.simple_fsdp import DataParallelMesh

    experts = apply_expert_parallel(a.model, a.dims.ep_mesh, a.replay)
    where = DataParallelMesh(a.dims.expert_param_mesh, a.dims.expert_dp_mode, a.dims.expert_param_ndim)
    return dict.fromkeys(experts, where)


def _on(cfg: JobConfig, dims: ParallelDims) -> bool:
    return dims.ep_enabled


def step_time(work: StageWork) -> float:
    """Per block with routed experts (`ModelCost.block.expert_parallel_elements` per token, averaged over the
    blocks): the dispatch and the combine in forward, their gradients in backward, and both again where the
    block's forward is recomputed (full or selective AC: the all-to-all is no saved op); exposed, since
    the experts wait for their rows and the next layer for the combine. Under TP every tp rank exchanges
    the whole gathered sequence's rows (the MoE layer is not split). Routing is taken as balanced."""
    elements = work.cost.block.expert_parallel_elements
    if not elements:
        return 0.0
    one = work.all_to_all(work.tokens * elements * work.itemsize)
    return (4 * work.blocks + 2 * (work.full + work.selective)) * one


UNIT = ParallelismUnit(
    name="expert",
    on=_on,
    rules=when_on(_on, check_expert_parallel),
    apply=_apply,
    graph_break=dispatches,
    step_time=step_time,
    group=lambda dims: (dims.ep, dims.tp),
    comm_words="ep all-to-alls",
)
"""Expert parallelism as one unit (`parallelism.ParallelismUnit`): its group is the innermost `ep` ranks of
dp_shard x cp, `tp` ranks apart; the all-to-alls' buffers are the family's activation model's
(`models/qwen3_moe/activations.py`)."""
