"""Putting a run together, the one way every tool does it (trainer, dry run, HF tool, benchmarks, tests):

    plan = RunPlan.build(cfg, world_size)     everything derived from config + world size, checked first
    device = init_device()                    cuda:LOCAL_RANK, else cpu
    init_distributed(cfg, device)             the process group: torchrun's, or one rank of our own
    loader = build_loader(plan, dp_rank)      the data-parallel rank's stream of batches (run/loader.py)
    model = build_model(plan, device)         meta -> parallelize (the framework's order) -> materialise -> init
    training = build_training(plan, device)   the step runner, its step policy chosen from the memory estimate

A single process is a world of one with the same plan as any world, so one GPU trains as it would on many.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from titanlite.compile.phase import Compilation
from titanlite.config import JobConfig
from titanlite.parallelisms.layout import Layout
from titanlite.parallelisms.parallel_dims import ParallelDims
from titanlite.parallelisms.parallelize import apply_step_policy, parallelize, staging, step_hooks
from titanlite.parallelisms.step_context import StepContext
from titanlite.parallelisms.tied_parameters import TiedParameters
from titanlite.planning.memory import (
    MemoryEstimate,
    StageMemory,
    StepChoice,
    estimate,
    first_fitting,
    pipeline_estimate,
)
from titanlite.planning.run_plan import RunPlan
from titanlite.run.step import LocalRunner, StepRunner, training_loss_fn

CUDA_ALLOC_CONF = "expandable_segments:True"
"""The CUDA caching allocator's default setting for training: segments that grow in place instead of new
fixed-size blocks, so memory freed by one step's differently sized buffers (gathers, activations under
AC, compiled graphs' temporaries) is reused rather than fragmented; TorchTitan's default too."""


def default_alloc_conf(environ: dict[str, str]) -> None:
    """Set `PYTORCH_ALLOC_CONF` to `CUDA_ALLOC_CONF` unless the user configured the allocator (under
    that name or the older `PYTORCH_CUDA_ALLOC_CONF`). The allocator reads it once, at its first use:
    call before anything touches CUDA memory."""
    if "PYTORCH_ALLOC_CONF" not in environ and "PYTORCH_CUDA_ALLOC_CONF" not in environ:
        environ["PYTORCH_ALLOC_CONF"] = CUDA_ALLOC_CONF


CACHE_KEY_TAG_ENV = "TORCH_COMPILE_CACHE_KEY_TAG"
"""torch's variable for `torch.compiler.config.cache_key_tag`, read when a process imports torch."""


def rank_compile_cache(environ: dict[str, str] | os._Environ, rank: int) -> None:
    """Key this rank's cached graphs by its rank, in the one compile cache the ranks of a host share
    (`TORCHINDUCTOR_CACHE_DIR`, else torch's default folder). torch keys some cached graphs on what is
    equal across ranks while their content is not: AOTAutograd's key of a DTensor program is its global
    spec, but the traced graph bakes in the rank's mesh coordinate (loss-parallel cross-entropy's vocab
    offset), so under one key every rank ran one rank's graph and the loss was wrong. torch's cache key
    tag is part of every cached graph's key (FX graph, AOTAutograd, dynamic-shape profile); `rank<r>` is
    appended to the user's tag, and set in `environ` too for inductor's compile workers. What is keyed
    by its own source stays shared: the ranks build each C++ kernel once (one rank compiles it while the
    others wait for its lock, then load it). A rank's graphs still serve it on the next launch of the
    same layout (the key holds the mesh). Idempotent: a process that builds again keeps one rank in the tag."""
    import torch.compiler.config as compiler_config

    user = re.sub(r"(^|-)rank\d+$", "", compiler_config.cache_key_tag)  # without a rank set before
    tag = f"{user}-rank{rank}" if user else f"rank{rank}"
    compiler_config.cache_key_tag = tag
    environ[CACHE_KEY_TAG_ENV] = tag


def init_device() -> torch.device:
    """This rank's device: `cuda:LOCAL_RANK` where CUDA exists, else the CPU. On CUDA, first the
    allocator's default (`default_alloc_conf`), before the device's first allocation."""
    if torch.cuda.is_available():
        default_alloc_conf(os.environ)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def world_from_env() -> tuple[int, int]:
    """(rank, world size) as torchrun sets them; one process without torchrun is rank 0 of 1."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(cfg: JobConfig, device: torch.device) -> None:
    """Join the job's process group (NCCL on CUDA, gloo on CPU); an existing group is kept.

    Under torchrun the group comes from its rendezvous. One process started without torchrun gets a
    one-rank group on an in-process store, so it runs the same plan (meshes, DTensor, DCP) as any world.
    """
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=cfg.comm.init_timeout_seconds)
    # device_id makes NCCL initialise eagerly and lets mesh subgroups split from the world communicator.
    device_id = device if device.type == "cuda" else None
    if device.type == "cuda":
        prepare_flight_recorder(cfg.job.dump_folder, os.environ)
    if "MASTER_ADDR" not in os.environ and world_from_env()[1] == 1:
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, device_id=device_id
        )
        return
    # torchrun keeps one store across restarts; without a per-attempt prefix a restarted rank can read
    # the previous attempt's peer addresses and fail to connect.
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"titanlite/attempt{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, device_id=device_id)


FLIGHT_RECORDER_ENTRIES = 20_000
"""Collectives each rank's NCCL flight recorder keeps. A step at scale issues thousands (per-block gathers
and reduce-scatters on several mesh groups, pipeline sends, microbatches): 2,000 would hold less than one
step of a large layout, and the collective a hang started at would be gone from the dump."""


def nccl_env_defaults(dump_folder: str, rank: int) -> dict[str, str]:
    """NCCL's flight recorder on by default, dumped when a collective times out (as TorchTitan documents
    it): the last `FLIGHT_RECORDER_ENTRIES` collectives of every rank land in
    `<dump_folder>/comm_traces/rank_<r>` for debugging a hang. Users' own settings win (the caller only
    sets what is unset)."""
    return {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(FLIGHT_RECORDER_ENTRIES),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": os.path.join(os.path.abspath(dump_folder), "comm_traces", "rank_"),
    }


def prepare_flight_recorder(dump_folder: str, environ: dict[str, str] | os._Environ) -> None:
    """Set NCCL's flight-recorder defaults where the user has not (`nccl_env_defaults`) and create the
    folder its dumps go to: NCCL writes `<prefix><rank>` there on a timeout and does not create it, so
    without this the traces of a hang would be lost. Every rank, before its process group exists."""
    for key, value in nccl_env_defaults(dump_folder, world_from_env()[0]).items():
        environ.setdefault(key, value)
    folder = os.path.dirname(environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"])
    if folder:
        os.makedirs(folder, exist_ok=True)


def apply_train_timeout(cfg: JobConfig, dims: ParallelDims) -> dict[str, timedelta]:
    """Shorten every process group's timeout to `comm.train_timeout_seconds` (after the first step, which
    includes compilation): the world and each mesh group (dp, tp, the flattened dp), whose collectives
    would otherwise keep the backend's default (NCCL 10 min, gloo 30 min). A barrier first, so no rank
    shortens a timeout while a peer is still compiling. Returns the timeouts it set, by group."""
    timeout = timedelta(seconds=cfg.comm.train_timeout_seconds)
    dist.barrier()
    groups = {"world": dist.group.WORLD, **(dims.process_groups() if dims.mesh_built else {})}
    # torch >= 2.15 deprecates the private setter (a FutureWarning in every rank's output) for a public one.
    set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
    for group in groups.values():
        set_timeout(timeout, group)
    return {name: timeout for name in groups}


def build_model(
    plan: RunPlan, device: torch.device, mesh_device_type: str | None = None, stage: int | None = None
) -> nn.Module:
    """The model as every run builds it: on the meta device, parallelized (`parallelisms/parallelize.py`:
    the parallelisms' order with AC and compile), then materialised on `device` and
    initialised from the seed.

    A process group must exist. The mesh is built here unless it already is (`mesh_device_type`
    defaults to `device`'s type). On `device` "meta" the model stays unmaterialised (the dry run).
    `stage`: build only that pipeline stage (`plan.pipeline`), cut on the meta device before the order
    (`parallelism.Stages.keep`).
    """
    model = _parallelized_on_meta(plan, mesh_device_type or device.type, stage)
    if device.type != "meta":
        _materialise(plan, model, device)
    return model


def _parallelized_on_meta(plan: RunPlan, mesh_device_type: str, stage: int | None) -> nn.Module:
    if not plan.dims.mesh_built:
        plan.dims.build_mesh(mesh_device_type)
    with torch.device("meta"):
        model = plan.spec.model_cls(plan.model_args, seq_len=plan.cfg.training.seq_len)
    if stage is not None:
        staged = staging(plan.cfg, plan.dims)
        assert staged is not None and plan.pipeline is not None
        staged.keep(model, plan.spec.units(model), plan.pipeline, stage)
    spec = plan.spec
    return parallelize(
        model,
        spec.units(model),
        spec.parallel.tp_styles,
        plan.dims,
        plan.cfg,
        high_precision=spec.shape.high_precision,
        compiler=Compilation.of(plan.cfg, plan.dims),
    )


def _materialise(plan: RunPlan, model: nn.Module, device: torch.device) -> None:
    # `to_empty` materialises each module's parameters on their own: a tied one is tied back before init.
    tied = TiedParameters.of(model)
    model.to_empty(device=device)
    tied.retie(model)
    model.init_weights(seed=plan.cfg.training.seed, buffer_device=device)


def rank_estimate(plan: RunPlan, parts: dict[int | None, nn.Module], layout: Layout, pp_rank: int) -> MemoryEstimate:
    """One rank's memory under `layout` (`planning.memory`): its whole model (`parts` = {None: model}) or its
    pipeline stages ({stage: module}), each stage for one microbatch, combined with the microbatches its
    schedule keeps in flight on pipeline rank `pp_rank`."""
    spec, args = plan.spec, plan.model_args
    assert spec.planning.activation_bytes is not None
    if plan.pipeline is None:
        (model,) = parts.values()
        return estimate(model, spec.units(model), spec.planning.activation_bytes(args, layout), layout)
    sp, microbatch = plan.pipeline, plan.cfg.parallelism.pipeline_parallel_microbatch_size
    stages = []
    for s, part in parts.items():
        assert s is not None
        stage_layout = layout.stage(sp.blocks(s), s == sp.n_stages - 1, microbatch)
        acts = spec.planning.activation_bytes(args, stage_layout)
        est = estimate(part, spec.units(part), acts, stage_layout)
        first, last = s == 0, s == sp.n_stages - 1
        in_flight = sp.stage_in_flight(pp_rank)[sp.stages_of(pp_rank).index(s)]
        stages.append(StageMemory(s, est, acts["held"], acts["boundary"], acts["input_saved"], first, last, in_flight))
    return pipeline_estimate(stages, sp.microbatches, layout)


def choose_step_policy(
    plan: RunPlan,
    ranks: dict[int, dict[int | None, nn.Module]],
    capacity: int,
    max_over_ranks: Callable[[list[int]], list[int]] | None = None,
    device_type: str = "cuda",
) -> StepChoice:
    """The step policy of the run (`planning.memory.first_fitting`), the one decision the trainer and the dry
    run share: every candidate the config allows (`plan.step_candidates`) is estimated on each planned rank
    (`ranks`: pipeline rank -> its parallelized model or stages, on any device, meta included),
    `max_over_ranks` (the trainer: a MAX over every rank, so all ranks choose alike) combines the worst totals, and the
    first candidate that fits comfortably in `capacity` bytes wins."""
    candidates, fixed = plan.step_candidates, plan.step_fixed
    if len(candidates) == 1 or plan.spec.planning.activation_bytes is None:
        return first_fitting(candidates, [0] * len(candidates), capacity, fixed)
    totals = [
        max(rank_estimate(plan, parts, plan.layout(c, device_type), r).total for r, parts in ranks.items())
        for c in candidates
    ]
    return first_fitting(candidates, max_over_ranks(totals) if max_over_ranks else totals, capacity, fixed)


def device_memory(device: torch.device) -> int:
    """Bytes one rank may plan with: its GPU's memory, or on CPU the host's memory over the node's ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


@dataclass
class TrainingModel:
    """What the trainer trains: the step runner (this rank's model, or its pipeline stages and their
    schedule) and the step policy it runs."""

    runner: StepRunner
    step_choice: StepChoice

    @property
    def model(self) -> nn.Module:
        """This rank's module: its stages as one under PP."""
        return self.runner.model


def step_context(plan: RunPlan, step_choice: StepChoice) -> StepContext:
    """The step's loss and reduction (`StepContext`): the configured loss, loss parallel, clipping, the
    family's extra loss term, and the step policy where it applies (data parallelism over several
    backwards)."""
    policy = plan.effective(step_choice.policy)
    return StepContext(
        training_loss_fn(plan.cfg),
        loss_parallel=plan.loss_parallel,
        max_norm=plan.cfg.training.max_norm,
        reduce_once=policy.reduce_once,
        keep_gathers=policy.keep_gathers,
        extra_loss=plan.spec.hooks.extra_loss,
        hooks=step_hooks(plan.cfg, plan.dims),
    )


def build_training(plan: RunPlan, device: torch.device) -> TrainingModel:
    """This rank's model, or its pipeline stages and their schedule, each built as `build_model` builds
    one, with the step policy decided between the parallelize plan and materialisation (one build): the
    memory estimate of the meta-device modules, agreed over every rank, applied before anything is allocated
    (`parallelize.apply_step_policy`: kept gathers turn reshard-after-forward off). Returns the step
    runner over them."""
    if not plan.dims.mesh_built:
        plan.dims.build_mesh(device.type)
    pp_rank = plan.dims.pp_rank_of(dist.get_rank())
    stages: tuple[int | None, ...] = plan.pipeline.stages_of(pp_rank) if plan.pipeline is not None else (None,)
    parts = {s: _parallelized_on_meta(plan, device.type, s) for s in stages}

    def max_over_ranks(totals: list[int]) -> list[int]:
        worst = torch.tensor(totals, dtype=torch.int64, device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        return worst.tolist()

    step_choice = choose_step_policy(plan, {pp_rank: parts}, device_memory(device), max_over_ranks, device.type)
    for part in parts.values():
        apply_step_policy(part, step_choice.policy, plan.cfg, plan.dims)
        _materialise(plan, part, device)
    context = step_context(plan, step_choice)
    if plan.pipeline is None:
        return TrainingModel(LocalRunner(parts[None], device, context, plan.cfg.model.attn_mask_type), step_choice)
    stage_parts = {s: m for s, m in parts.items() if s is not None}
    staged = staging(plan.cfg, plan.dims)
    assert staged is not None
    runner = staged.runner(plan.pipeline, stage_parts, plan.dims, device, context, plan.backwards_per_step)
    return TrainingModel(runner, step_choice)
