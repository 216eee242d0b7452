"""Context parallelism: the ranks of the `cp` mesh dim each hold part of every sequence of the batch.

Head-tail load balancing: a sequence is cut into 2 x cp chunks and cp rank r holds chunks r and 2cp-1-r, so
every rank has the same causal attention work; the step runners shard every per-token tensor this way through
`StepContext` (`SequenceShard.shard`). The queries stay sharded; the keys and values of the whole sequence are
all-gathered over cp, so any mask works from the global indices. The gather is issued as soon as keys and
values exist (`start_gather`) and waited for where attention needs them (`finish_gather`), and backward mirrors
it, so the query projection and RoPE overlap the collective. Gradients are averaged over dp_shard x cp, which
gives the batch's mean. The model sees only the seam: a module with a `context_parallel` attribute gets this
rank's `SequenceShard` there. Details and measurements: docs/long_context.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titanlite.config import JobConfig
from titanlite.errors import ConfigError
from titanlite.parallelisms.parallel_dims import ParallelDims
from titanlite.parallelisms.parallelism import ApplyArgs, ParallelismUnit, StageWork, StepHook, when_on

SEAM = "context_parallel"
"""The attribute a module declares (None) to receive the rank's `SequenceShard`."""


def head_tail_order(degree: int) -> list[int]:
    """The sequence's 2 x `degree` chunks in the order the ranks hold them: rank 0's two, rank 1's two, ..."""
    return [c for r in range(degree) for c in (r, 2 * degree - 1 - r)]


def shard_sequence(t: torch.Tensor, degree: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s part of `t` along `dim`: chunks `rank` and 2 x degree - 1 - rank of 2 x `degree`."""
    if degree == 1:
        return t
    chunks = t.chunk(2 * degree, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * degree - 1 - rank]], dim=dim)


def unshard_sequence(t: torch.Tensor, degree: int, dim: int = 1) -> torch.Tensor:
    """The inverse of sharding on every rank and concatenating in rank order: `t` (all ranks' parts, rank
    0's first, along `dim`) back in sequence order."""
    if degree == 1:
        return t
    held = t.chunk(2 * degree, dim=dim)
    by_chunk = dict(zip(head_tail_order(degree), held))
    return torch.cat([by_chunk[c] for c in range(2 * degree)], dim=dim)


def sequence_positions(seq_len: int, degree: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The global indices of the tokens rank `rank` holds of a `seq_len`-token sequence."""
    return shard_sequence(torch.arange(seq_len, device=device), degree, rank, dim=0)


@dataclass(frozen=True)
class SequenceShard(StepHook):
    """This rank's part of every sequence: what the model's attention calls (module docstring)."""

    degree: int
    rank: int
    group_name: str
    """The cp process group, by name (functional collectives take it so, and compiled code too)."""

    @classmethod
    def of(cls, cp_mesh: DeviceMesh) -> SequenceShard:
        return cls(cp_mesh.size(), cp_mesh.get_local_rank(), cp_mesh.get_group().group_name)

    def shard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a per-token tensor of the batch ([batch, seq, ...] with `dim` 1)."""
        return shard_sequence(t, self.degree, self.rank, dim)

    def batch(self, t: torch.Tensor) -> torch.Tensor:
        """The step hook (`parallelism.StepHook`): this rank's tokens of a microbatch's per-token tensor."""
        return self.shard(t)

    def loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The step hook: a rank's loss is the mean over its own tokens, as it is (module docstring)."""
        return loss

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """The global indices of this rank's `local_len` tokens (a sequence of degree x local_len)."""
        return sequence_positions(local_len * self.degree, self.degree, self.rank, device)

    def held_positions(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """The global indices of the tokens this rank holds of a whole sequence of `seq_len` tokens."""
        return self.positions(seq_len // self.degree, device)

    def held(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """The step hook: the forward's positions and its mask's query rows are the tokens this rank holds."""
        return self.held_positions(seq_len, device)

    def start_gather(self, t: torch.Tensor, dim: int) -> PendingGather:
        """Issue the all-gather of every rank's part of `t` along `dim` and return without waiting for it
        (module docstring: Overlap); `finish_gather` gives the result."""
        local = t.movedim(dim, 0).contiguous()  # the gather stacks the ranks' parts along dim 0
        buffer = torch.ops._c10d_functional.all_gather_into_tensor(local.detach(), self.degree, self.group_name)
        return PendingGather(buffer, _WaitGradient.apply(local))

    def finish_gather(self, pending: PendingGather, dim: int) -> torch.Tensor:
        """The gather `start_gather` issued, waited for: every rank's part along `dim`, in sequence order;
        its gradient is reduce-scattered (summed) back to the ranks."""
        gathered = _FinishGather.apply(pending.buffer, pending.local, self.degree, self.group_name)
        return gathered.movedim(0, dim)


@dataclass(frozen=True)
class PendingGather:
    """An all-gather in flight (`SequenceShard.start_gather`)."""

    buffer: torch.Tensor
    """The collective's output, [degree x n, ...] in rank order; valid once waited for."""
    local: torch.Tensor
    """This rank's part, [n, ...]: the gather's autograd edge (its gradient waits for the reduce-scatter)."""


class _WaitGradient(torch.autograd.Function):
    """Identity whose backward waits for its incoming gradient's collective (the reduce-scatter that
    `_FinishGather.backward` issued): applied where the gather is issued, it runs in backward after the
    queries' backward, which autograd orders first (created later in forward)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor) -> torch.Tensor:
        return local.view_as(local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.ops._c10d_functional.wait_tensor(grad)


class _FinishGather(torch.autograd.Function):
    """Wait for the gathered buffer and put it in sequence order (forward); reorder the gradient back and
    issue its reduce-scatter without waiting (backward: `_WaitGradient` waits)."""

    @staticmethod
    def forward(ctx: Any, buffer: torch.Tensor, local: torch.Tensor, degree: int, group_name: str) -> torch.Tensor:
        ctx.degree, ctx.group_name = degree, group_name
        return unshard_sequence(torch.ops._c10d_functional.wait_tensor(buffer), degree, dim=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None, None]:
        chunks = grad.chunk(2 * ctx.degree, dim=0)
        by_rank = torch.cat([chunks[c] for c in head_tail_order(ctx.degree)], dim=0)
        reduced = torch.ops._c10d_functional.reduce_scatter_tensor(by_rank, "sum", ctx.degree, ctx.group_name)
        return None, reduced, None, None


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> SequenceShard:
    """Give every module of `model` that declares the seam (`SEAM`) this rank's `SequenceShard`."""
    shard = SequenceShard.of(cp_mesh)
    seams = [module for module in model.modules() if hasattr(type(module), SEAM)]
    assert seams, "RunPlan.build refuses context parallelism for a family without the seam"
    for module in seams:
        setattr(module, SEAM, shard)
    return shard


def check_context_parallel(cfg: JobConfig, dims: ParallelDims, spec: Any, args: Any) -> None:
    """What context parallelism needs: a model with the seam, and sequences that cut into 2 x cp equal
    chunks (whose cp shares tensor parallelism cuts again)."""
    seq, cp = cfg.training.seq_len, dims.cp
    if not spec.parallel.context_parallel:
        raise ConfigError(f"model {spec.name} does not support context parallelism: set context_parallel_degree 1")
    if seq % (2 * cp):
        raise ConfigError(
            f"training.seq_len {seq} is not a multiple of 2 x context_parallel_degree {cp} "
            "(each rank holds two equal chunks of every sequence, one from each end)"
        )
    if dims.tp_enabled and (seq // cp) % dims.tp:
        raise ConfigError(
            f"training.seq_len {seq} / context_parallel_degree {cp} is not a multiple of tensor_parallel_degree "
            f"{dims.tp} (sequence parallelism splits each rank's tokens again)"
        )


def step_time(work: StageWork) -> float:
    """Per block: the all-gather of the whole sequence's keys and values (TP-local, compute dtype), its
    reduce-scatter of their gradients in backward, and the gather again when the block is recomputed (full
    or selective AC: the selective policy saves no all-gather); all exposed, since attention waits for
    the gather and the keys' and values' projections' backward for the reduction."""
    kv_bytes = work.microbatch * work.seq_len * work.cost.block.context_parallel_elements * work.itemsize / work.tp
    return (2 * work.blocks + work.full + work.selective) * work.ring(kv_bytes)


def _apply(a: ApplyArgs) -> dict:
    """After TP (whose layouts split each rank's tokens further), before AC and compile wrap the blocks."""
    assert a.dims.cp_mesh is not None
    apply_context_parallel(a.model, a.dims.cp_mesh)
    return {}


def _step_hook(dims: ParallelDims) -> SequenceShard | None:
    return SequenceShard.of(dims.cp_mesh) if dims.cp_mesh is not None else None


def _on(cfg: JobConfig, dims: ParallelDims) -> bool:
    return dims.cp_enabled


UNIT = ParallelismUnit(
    name="context",
    on=_on,
    rules=when_on(_on, check_context_parallel),
    apply=_apply,
    step_hook=_step_hook,
    step_time=step_time,
    group=lambda dims: (dims.cp, dims.tp),
    comm_words="cp K/V collectives",
)
"""Context parallelism as one unit (`parallelism.ParallelismUnit`)."""
