"""Pipeline parallelism: the model cut into stages along its blocks, run by torch.distributed.pipelining.

    StageLayout.of(cfg.parallelism, n_blocks, local_batch)   stages, their blocks, microbatches: checked
    keep_stage(model, units, plan, stage)                   on the meta device: delete what a stage lacks
    PipelineRunner(plan, parts, dims, device, context, backwards)   PipelineStages + torch's schedule

A stage is the whole model with the other stages' blocks deleted, so parameter names do not change and
initialisation, checkpoints and every per-stage layout work as on one process. Each microbatch's loss is divided
by (microbatches x accumulation batches) inside the step's `StepContext`, so the summed gradient is that of the
mean over the rank's batch (torch's `scale_grads` is off); the step's reduction policy spans all microbatches.
Stages, schedules, data and checks: docs/parallelism.md#pipeline-parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from titanlite.config import JobConfig, Parallelism
from titanlite.data.batch import Batch
from titanlite.errors import ConfigError
from titanlite.parallelisms.parallel_dims import ParallelDims
from titanlite.parallelisms.parallelism import ApplyArgs, ParallelismUnit, Stages
from titanlite.parallelisms.pipeline.rules import check_pipeline
from titanlite.parallelisms.units import Units

if TYPE_CHECKING:
    from titanlite.parallelisms.step_context import StepContext

# torch.distributed.pipelining is imported when a pipeline is built: importing it pulls in Dynamo
# (~0.4 s per process), which runs without pipeline parallelism should not pay. The runner's step
# (DTensor, through the step context and clipping) is imported where it runs: the run plan's
# `StageLayout` is built by the launcher's preflight, which imports no DTensor.
SINGLE_STAGE = {"GPipe": "ScheduleGPipe", "1F1B": "Schedule1F1B"}
"""Schedules of one stage per rank (torch.distributed.pipelining class names)."""
MULTI_STAGE = {"Interleaved1F1B": "ScheduleInterleaved1F1B", "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble"}
"""Schedules of several (looped) stages per rank."""


@dataclass(frozen=True)
class StageLayout:
    """Which blocks each stage holds, which stages each pipeline rank runs, and the microbatches."""

    degree: int
    """Pipeline ranks (`parallelism.pipeline_parallel_degree`)."""
    schedule: str
    stages_per_rank: int
    starts: tuple[int, ...]
    """The first block of each stage, in stage order (starts[0] == 0)."""
    n_blocks: int
    microbatches: int
    """Microbatches per schedule step: the local batch over the microbatch size."""

    @classmethod
    def of(cls, p: Parallelism, n_blocks: int, local_batch: int) -> StageLayout:
        """The plan of config section `parallelism` (`p`) for a model of `n_blocks` blocks; a plan torch's
        schedule cannot run is a `ConfigError`."""
        pp, name = p.pipeline_parallel_degree, p.pipeline_parallel_schedule
        per_rank = p.pipeline_parallel_stages_per_rank
        if per_rank == -1:
            per_rank = 1 if name in SINGLE_STAGE else 2
        if name in SINGLE_STAGE and per_rank != 1:
            raise ConfigError(
                f"parallelism.pipeline_parallel_schedule {name} runs one stage per rank, "
                f"got pipeline_parallel_stages_per_rank {per_rank} (use Interleaved1F1B)"
            )
        n_stages = pp * per_rank
        if n_stages > n_blocks:
            raise ConfigError(
                f"parallelism: {n_stages} pipeline stages (degree {pp} x {per_rank} per rank) "
                f"but the model has {n_blocks} blocks; each stage needs at least one"
            )
        mb = p.pipeline_parallel_microbatch_size
        if local_batch % mb:
            raise ConfigError(
                f"training.local_batch_size {local_batch} is not a multiple of "
                f"parallelism.pipeline_parallel_microbatch_size {mb}"
            )
        n_micro = local_batch // mb
        check_microbatches(name, n_micro, pp)
        points = list(p.pipeline_parallel_split_points)
        if points:
            if (
                len(points) != n_stages - 1
                or points != sorted(set(points))
                or not 0 < points[0] <= points[-1] < n_blocks
            ):
                raise ConfigError(
                    f"parallelism.pipeline_parallel_split_points {points}: expected {n_stages - 1} increasing "
                    f"block indices in 1..{n_blocks - 1} (where stages 1..{n_stages - 1} begin)"
                )
            starts = (0, *points)
        else:
            starts = balanced_starts(n_blocks, n_stages)
        return cls(pp, name, per_rank, starts, n_blocks, n_micro)

    @property
    def n_stages(self) -> int:
        return self.degree * self.stages_per_rank

    def blocks(self, stage: int) -> range:
        """The block indices stage `stage` holds."""
        end = self.starts[stage + 1] if stage + 1 < self.n_stages else self.n_blocks
        return range(self.starts[stage], end)

    def stages_of(self, pp_rank: int) -> tuple[int, ...]:
        """The stages pipeline rank `pp_rank` runs, looped (r, r + pp, ...)."""
        return tuple(pp_rank + k * self.degree for k in range(self.stages_per_rank))

    @property
    def bubble_fraction(self) -> float:
        """Idle fraction of a schedule step with equal stage times, for p ranks, v stages per rank and m
        microbatches: a rank computes v m stage passes in a step of v max(m, p) + min(m, p) - 1, that is
        (p - 1) / (v m + p - 1) once m >= p (GPipe, 1F1B: v = 1; interleaving divides the bubble by v).
        With fewer microbatches than ranks a microbatch crosses all v p stages one after another, so
        interleaving cannot shorten the step. For the zero-bubble schedule this is the interleaved 1F1B
        bound it improves on (an upper bound)."""
        p, v, m = self.degree, self.stages_per_rank, self.microbatches
        span = v * max(m, p) + min(m, p) - 1
        return 1 - v * m / span

    def in_flight(self, pp_rank: int) -> int:
        """The most microbatches one of the rank's stages holds at once (`stage_in_flight`)."""
        return max(self.stage_in_flight(pp_rank))

    def stage_in_flight(self, pp_rank: int) -> tuple[int, ...]:
        """Per stage the rank runs (in `stages_of` order), the most microbatches whose forward has run and
        whose backward has not: all of them for GPipe; for 1F1B the warm-up depth (p - rank); for the
        interleaved schedules, the order torch's implementation runs: (v - 1) M + 2 (p - rank - 1) forwards
        of warm-up (M microbatches per round, all of them at most), then a forward and a backward at a
        time. Forwards go through the rank's stages first to last, M microbatches at a time, and backwards
        last to first, so the last stage of the last rank runs each microbatch's backward right after its
        forward while its first stage holds all M."""
        p, v, m = self.degree, self.stages_per_rank, self.microbatches
        if self.schedule == "GPipe":
            return (m,)
        if self.schedule == "1F1B":
            return (min(m, p - pp_rank),)
        per_round = m // max(1, m // p)
        total = m * v
        warmup = min((v - 1) * per_round + 2 * (p - pp_rank - 1), total)
        held, peak = [0] * v, [0] * v

        def forward(op: int) -> None:
            s = (op // per_round) % v
            held[s] += 1
            peak[s] = max(peak[s], held[s])

        def backward(op: int) -> None:
            held[v - 1 - (op // per_round) % v] -= 1

        for op in range(warmup):
            forward(op)
        for op in range(total - warmup):
            forward(warmup + op)
            backward(op)
        for op in range(total - warmup, total):
            backward(op)
        return tuple(peak)

    def describe(self) -> str:
        spans = ", ".join(f"{b.start}-{b.stop - 1}" for b in map(self.blocks, range(self.n_stages)))
        return (
            f"pipeline {self.schedule}: {self.n_stages} stages ({self.stages_per_rank} per rank; blocks {spans}), "
            f"{self.microbatches} microbatches per step, bubble {100 * self.bubble_fraction:.1f}%"
        )


def check_microbatches(schedule: str, n_micro: int, pp: int) -> None:
    """torch's rules for the microbatch count, checked before any rank starts."""
    if schedule == "1F1B" and n_micro < pp:
        raise ConfigError(
            f"pipeline schedule 1F1B needs at least as many microbatches as stages: {n_micro} microbatches "
            f"(local batch / pipeline_parallel_microbatch_size) < pipeline_parallel_degree {pp}"
        )
    if schedule in MULTI_STAGE:
        rounds = max(1, n_micro // pp)
        if n_micro % rounds:
            raise ConfigError(
                f"pipeline schedule {schedule} needs a microbatch count that is a multiple of "
                f"{rounds} (microbatches // pipeline_parallel_degree); got {n_micro}"
            )


def balanced_starts(n_blocks: int, n_stages: int) -> tuple[int, ...]:
    """Stage boundaries that even out blocks + (embedding on the first, output on the last stage), each
    stage keeping at least one block."""
    starts = [0]
    for s in range(1, n_stages):
        ideal = int(s * (n_blocks + 2) / n_stages + 0.5) - 1
        starts.append(min(max(ideal, starts[-1] + 1), n_blocks - (n_stages - s)))
    return tuple(starts)


def keep_stage(model: nn.Module, units: Units, plan: StageLayout, stage: int) -> None:
    """Reduce `model` (on the meta device) to stage `stage`: the other blocks are deleted from their
    container, the embedding (`units.before`) is kept on the first stage only and the norm and output
    (`units.after`) on the last only. Names of what remains are unchanged."""
    held = plan.blocks(stage)
    for i, fqn in enumerate(units.blocks):
        if i not in held:
            container, key = fqn.rsplit(".", 1)
            del model.get_submodule(container)[key]
    if stage > 0:
        for name in units.before:
            setattr(model, name, None)
    if stage < plan.n_stages - 1:
        for name in units.after:
            setattr(model, name, None)


class StageUnion(nn.Module):
    """This rank's stages as one module with the model's own parameter names and `args`, for the
    optimizer, checkpoints (DCP by FQN), the family's step hooks and tests. It shares the stages' modules
    and is never called."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        if hasattr(parts[0], "args"):
            self.args = parts[0].args
        for part in parts:
            for name, child in part.named_children():
                if isinstance(child, nn.ModuleDict):
                    if name not in self._modules:
                        self._modules[name] = nn.ModuleDict()
                    self._modules[name].update(child)
                else:
                    self._modules[name] = child


def union(parts: list[nn.Module]) -> nn.Module:
    """A rank's stages as one module (`Stages.union`): the stage itself, or their `StageUnion`."""
    return parts[0] if len(parts) == 1 else StageUnion(parts)


class PipelineRunner:
    """This rank's pipeline stages and the schedule that runs them: the step runner under pipeline
    parallelism (`step.StepRunner`), in the step's one `StepContext` like the local runner.

    `parts` maps stage index -> the stage's module (built by `keep_stage` and parallelized); `model` is
    the one module the rest of the trainer sees: the stage itself, or a `StageUnion` of several.
    `backwards_per_step` is the run plan's: the schedule's microbatches times the accumulation batches."""

    def __init__(
        self,
        plan: StageLayout,
        parts: dict[int, nn.Module],
        dims: ParallelDims,
        device: torch.device,
        context: StepContext,
        backwards_per_step: int,
    ):
        from torch.distributed import pipelining

        self.plan, self.dims, self.device, self.context = plan, dims, device, context
        self.backwards_per_step = backwards_per_step
        assert dims.pp_mesh is not None
        self.group = dims.pp_mesh.get_group()
        self.parts = dict(sorted(parts.items()))
        self.stages = [
            pipelining.PipelineStage(module, index, plan.n_stages, device, group=self.group)
            for index, module in self.parts.items()
        ]
        self.has_first = 0 in self.parts
        self.has_last = plan.n_stages - 1 in self.parts
        kwargs: dict[str, Any] = dict(n_microbatches=plan.microbatches, loss_fn=self._loss, scale_grads=False)
        if plan.schedule in SINGLE_STAGE:
            self.schedule = getattr(pipelining, SINGLE_STAGE[plan.schedule])(self.stages[0], **kwargs)
        else:
            self.schedule = getattr(pipelining, MULTI_STAGE[plan.schedule])(self.stages, **kwargs)
        self.model = union(list(self.parts.values()))
        self._step: tuple[StepContext, int] | None = None
        """The context and backwards of the step the schedule is running (its loss hook reads them)."""

    def _loss(self, pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The last stage's microbatch loss, with the family's extra term of the last stage's module,
        which holds what the earlier stages handed on (`ModelSpec.hooks.extra_loss_across_stages`)."""
        assert self._step is not None
        context, backwards = self._step
        return context.microbatch_loss(pred, labels, backwards, self.parts[self.plan.n_stages - 1])

    def forward_backward(
        self,
        optimizer: torch.optim.Optimizer,
        batches: list[Batch],
        context: StepContext | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradients of the rank's batch through the schedule, clipped over every stage; returns (the
        replica's mean loss, on every rank; the global grad norm), like the local runner."""
        from titanlite.parallelisms.clipping import clip_grad_norm_
        from titanlite.parallelisms.step_context import replicated

        ctx = context or self.context
        optimizer.zero_grad(set_to_none=True)
        backwards = self.backwards_per_step
        assert backwards == self.plan.microbatches * len(batches), "one step takes the plan's accumulation batches"
        self._step = (ctx, backwards)
        for part in self.parts.values():
            ctx.before_step(part)
        total = torch.zeros((), device=self.device)
        with ctx.reduction(self.model, backwards, pipelined=True):
            for inputs, labels, _ in batches:  # positions: the plan refuses block_causal masks under PP
                inputs, labels = ctx.shard(inputs), ctx.shard(labels)
                losses: list[torch.Tensor] = []
                # Pinned host batches (the loader pins them on CUDA) copy without blocking the host. Contiguous:
                # torch 2.11's stage checks strides against its contiguous example input.
                args = (inputs.to(self.device, non_blocking=True).contiguous(),) if self.has_first else ()
                target = labels.to(self.device, non_blocking=True) if self.has_last else None
                with ctx.loss_scope():
                    self.schedule.step(
                        *args, target=target, losses=losses if self.has_last else None, return_outputs=False
                    )
                for loss in losses:
                    total += replicated(loss).detach()
        dist.all_reduce(total, group=self.group)
        params = [p for module in self.parts.values() for p in module.parameters()]
        grad_norm = clip_grad_norm_(params, ctx.max_norm, group=self.group)
        return total, grad_norm

    def evaluate(self, batch: Batch) -> torch.Tensor:
        """Validation under pipeline parallelism is refused by the config (held-out batches would need a
        forward-only schedule); this runner has none."""
        raise NotImplementedError("validation with pipeline parallelism")


def _plan(cfg: JobConfig, dims: ParallelDims, args: Any) -> StageLayout:
    return StageLayout.of(cfg.parallelism, args.n_layers, cfg.training.local_batch_size)


def _apply(a: ApplyArgs) -> dict:
    """Nothing in the order: the build cuts each stage before it (`Stages.keep`), and the order applies the
    other parallelisms to the stage as to a whole model."""
    return {}


UNIT = ParallelismUnit(
    name="pipeline",
    on=lambda cfg, dims: dims.pp_enabled,
    rules=check_pipeline,
    apply=_apply,
    stages=Stages(plan=_plan, keep=keep_stage, runner=PipelineRunner, union=union),
)
"""Pipeline parallelism as one unit (`parallelism.ParallelismUnit`): its send/recv and bubble are the
step-time model's own terms (`planning/step_time.py`)."""
