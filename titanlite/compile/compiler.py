"""torch.compile of the model: the whole model as one graph or each transformer block on its own, with
SimpleFSDP's graph passes and the compile report.

Scopes (`compile.scope`, `auto` resolved by `scope.py`): `model` compiles the model's forward as one
graph, whose manual scheduler prefetches the next block's gathers and defers reduce-scatter waits, full
AC being recompute tags in it (`passes.RecomputeTagPass`); `block` compiles each block with
`fullgraph=True`, identical blocks sharing one trace, a fully checkpointed block keeping its eager
checkpoint around its compiled body; `prefetch` is `block` whose SimpleFSDP collectives eager hooks
issue one unit ahead (`prefetch.py`). Under SimpleFSDP with `aot_eager` or `inductor` each compile unit
gets its own backend (`_Backend`): the min-cut partitioner, the bucketing pass and a recorder feeding
the `CompileReport`. What a parallelism needs of compiled code (inductor settings, a graph break) comes
from its unit (`parallelize.compile_options`, `parallelize.graph_break`). The why is in docs/compile.md.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from titanlite.compile.collectives import graph_collectives
from titanlite.compile.partitioner import Partitioner
from titanlite.compile.passes import BLOCK_BUCKET, BucketingPass, CostModel, RecomputeTagPass
from titanlite.compile.report import REPORT_NAME, CompileReport, Unit
from titanlite.compile.scope import resolve_scope, with_passes
from titanlite.config import JobConfig
from titanlite.errors import ConfigError
from titanlite.parallelisms.activation_checkpoint import CheckpointedBlock
from titanlite.parallelisms.data_parallel.reshard import ReshardPolicy
from titanlite.parallelisms.data_parallel.simple_fsdp import simple_fsdp_states
from titanlite.parallelisms.parallel_dims import ParallelDims
from titanlite.parallelisms.parallelize import compile_options, graph_break
from titanlite.parallelisms.units import Units


def check_compile(cfg: JobConfig, dims: ParallelDims, full_ac: bool) -> bool:
    """Whether compilation installs graph passes (`_with_passes`), after refusing what cannot compile:
    nothing named to compile, bucketing without those passes, and one model-wide graph over fully
    checkpointed blocks (`full_ac`) without them (a parallelism's own rules with compilation are its
    unit's). The run plan checks it before any rank starts; `apply_compile` asks it again for its answer."""
    c = cfg.compile
    if not c.components:
        raise ConfigError(
            "compile.enable is set but compile.components is empty: nothing would compile; name model and/or loss"
        )
    with_passes = _with_passes(cfg, dims)
    if c.bucketing != "none" and not with_passes:
        if not dims.dp_enabled:
            what = f"this layout has no data parallelism: {dims.describe_degrees()}"
        elif cfg.parallelism.dp_impl != "simple_fsdp":
            what = f"parallelism.dp_impl is {cfg.parallelism.dp_impl}"
        else:
            what = f"compile.backend is {c.backend}"
        raise ConfigError(
            f"compile.bucketing={c.bucketing} needs SimpleFSDP data parallelism and backend aot_eager or inductor "
            f"({what}); set compile.bucketing none"
        )
    if c.scope == "prefetch":
        _check_prefetch(cfg, dims, with_passes)
    if compile_scope(cfg, dims) == "model" and full_ac and not with_passes:
        raise ConfigError(
            "compile.scope=model with full activation checkpointing needs SimpleFSDP data parallelism and "
            "backend aot_eager or inductor (the checkpoint becomes recompute tags in the graph); use scope=block"
        )
    return with_passes


def _check_prefetch(cfg: JobConfig, dims: ParallelDims, with_passes: bool) -> None:
    """Refuse what the eager prefetcher (`prefetch.py`) does not handle, in one line each."""
    why = None
    if not with_passes:
        why = "SimpleFSDP data parallelism and backend aot_eager or inductor"
    elif cfg.activation_checkpoint.mode != "full":
        why = "activation_checkpoint.mode full (each block's eager checkpoint is what frees its weights)"
    elif dims.ep > 1 or dims.pp > 1:
        why = "no expert or pipeline parallelism"
    elif cfg.compile.bucketing != "transformer_block" or not cfg.compile.reorder:
        why = "bucketing transformer_block with reorder on (one flat gather per unit, issued a unit ahead)"
    elif cfg.parallelism.gradient_reduction == "per_step":
        why = "gradients reduced in every backward (gradient_reduction auto or per_microbatch)"
    if why is not None:
        raise ConfigError(f"compile.scope=prefetch needs {why}; use scope block or model")


def apply_compile(
    model: nn.Module,
    units: Units,
    ac: dict[str, CheckpointedBlock],
    cfg: JobConfig,
    dims: ParallelDims,
    reshard: ReshardPolicy,
) -> CompileReport | None:
    """Compile `model` as `cfg.compile` says, in place; returns the report when graph passes are installed.

    Call after activation checkpointing (`ac` is what `apply_ac` returned) and before data parallelism
    (compilation is lazy; SimpleFSDP's gathers are traced at the first step). The mesh must be built.
    `reshard` is the plan the data-parallel wrapper gets too: its freed gathers become recompute tags.
    """
    c = cfg.compile
    full_ac = tuple(name for name, a in ac.items() if a.mode == "full")
    with_passes = check_compile(cfg, dims, bool(full_ac))
    scope = compile_scope(cfg, dims)
    # The inductor settings this run's parallelisms need, on its compiled units only: nothing global is set.
    patches = compile_options(cfg, dims) if c.backend == "inductor" else {}
    if not with_passes:
        _compile_units(model, units, ac, scope, cfg, dims, lambda name, i: c.backend, patches)
        return None

    cost = _cost_model(c, dims) if c.bucketing != "none" else None
    report = CompileReport(
        labels=_group_labels(dims),
        settings={
            "scope": scope,
            "backend": c.backend,
            "bucketing": c.bucketing,
            "reorder": c.reorder,
            "n_blocks": len(units.blocks),
        },
        eager_params=0
        if scope in ("model", "prefetch")
        else sum(1 for n, _ in model.named_parameters() if not units.unit_of(n)),
        path=os.path.join(cfg.job.dump_folder, REPORT_NAME),
        cost_model=cost.as_dict() if cost is not None and c.bucketing == "auto" else None,
        # Under `prefetch` every backward reduces its unit's sinks itself (`prefetch.py`).
        routing_to_sinks=(lambda: False)
        if scope == "prefetch"
        else lambda: any(s.unreduced for s in simple_fsdp_states(model)),
    )
    bucketing = None
    if c.bucketing != "none" and scope != "prefetch":  # prefetch: the graphs hold no collectives
        plans = (BLOCK_BUCKET,) if scope == "block" else _model_buckets(units)
        bucketing = BucketingPass(
            c.bucketing,
            c.reorder,
            plans,
            block_scope=scope == "block",
            cost=cost,
            insert_overlap_deps=c.backend == "inductor",
        )
    shared: dict[tuple, _Backend] = {}

    if scope == "model":  # full checkpointing as recompute tags in the one graph (`RecomputeTagPass`)
        for name in full_ac:
            ac[name].in_graph = True

    def backend(name: str, index: int) -> _Backend:
        checkpointed: tuple[str, ...] = ()
        if scope == "model":
            saved, recompute_forward, checkpointed = reshard.kept(units), False, full_ac
        else:
            recompute_forward = name in ac and ac[name].mode == "full"
            saved = () if reshard.blocks[index] and not recompute_forward else ("",)
        # Blocks that compile alike (same checkpointing, same reshard tags) share one backend object: Dynamo
        # reuses a cache entry only for the backend that made it, so this is what lets them share one trace.
        key = (recompute_forward, saved, ac[name].mode if name in ac else "none")
        if key in shared:
            shared[key].unit.copies += 1
            return shared[key]
        unit = report.add_unit(name, recompute_forward)
        shared[key] = _Backend(c.backend, RecomputeTagPass(saved, checkpointed), bucketing, report, unit, patches)
        return shared[key]

    _compile_units(model, units, ac, scope, cfg, dims, backend)
    return report


def _with_passes(cfg: JobConfig, dims: ParallelDims) -> bool:
    return with_passes(cfg, dims.dp_enabled)


def compile_scope(cfg: JobConfig, dims: ParallelDims) -> str:
    """`compile.scope` resolved for the built mesh (`compile_scope.resolve_scope`)."""
    return resolve_scope(cfg, dims.dp_enabled, dims.ep, dims.pp, dims.dp)


def _compile_units(
    model: nn.Module,
    units: Units,
    ac: dict[str, CheckpointedBlock],
    scope: str,
    cfg: JobConfig,
    dims: ParallelDims,
    backend: Callable[[str, int], Any],
    options: dict[str, Any] | None = None,
) -> None:
    """Compile the model or each block with the backend `backend(name, index)` gives; `options`: inductor
    settings for a backend named "inductor" (a `_Backend` carries its own)."""
    extra: dict[str, Any] = {"options": options} if options else {}
    if scope == "model":  # the forward, not the module: its hooks stay eager, its state_dict names unchanged
        model.forward = torch.compile(model.forward, backend=backend("model", 0), fullgraph=True, **extra)
        return
    # Identical blocks share one Dynamo cache entry of the shared `forward` code (SimpleFSDP's parametrized
    # class is shared, `backend` hands them one backend object), so a model compiles each distinct block
    # once (twice at most: under reshard "default" the last block keeps its gathered weights).
    for i, (fqn, block) in enumerate(units.blocks.items()):
        checkpointed = ac.get(fqn)
        full = checkpointed is not None and checkpointed.mode == "full"
        fn = checkpointed.body if full else block.forward
        # A block that runs a parallelism eagerly (expert parallelism's dispatch) compiles around it.
        fullgraph = not graph_break(block, cfg, dims)
        compiled = torch.compile(fn, backend=backend(fqn, i), fullgraph=fullgraph, **_recompile_limit(fn), **extra)
        if full:
            checkpointed.body = compiled
        else:
            block.forward = compiled
        block.register_forward_pre_hook(_await_collective_inputs)


def _recompile_limit(fn: Callable[..., Any]) -> dict[str, int]:
    """The recompile limit of this model's compiled `fn`, set on its own `torch.compile` call (Dynamo's
    global limits stay as they are): the entries the code of `fn` already holds (other models in this
    process compile the same block code, and their entries count against this one's limit), plus
    Dynamo's default, plus room for a few variants (eval/no-grad, other backends). A recompile per
    block would still exceed it and fail loudly (`fullgraph=True`).

    Returned as `torch.compile`'s keyword, or none where `torch.compile` takes no `recompile_limit`
    (torch 2.11 and 2.12): there Dynamo's global limit applies, which one model per process stays under
    (identical blocks share one entry); only a process that builds many models (a test) can reach it."""
    if "recompile_limit" not in inspect.signature(torch.compile).parameters:
        return {}
    existing = len(torch._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__))
    return {"recompile_limit": existing + torch._dynamo.config.recompile_limit + 4}


def _await_collective_inputs(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Turn in-flight collective outputs (`AsyncCollectiveTensor`, e.g. the tensor-parallel embedding's
    output entering block 0) into plain tensors before they reach a compiled block.

    With such an input, the compiled backward (torch 2.13) hands back a plain-tensor gradient where the
    eager redistribute that produced the input expects a DTensor (`'Tensor' object has no attribute
    '_local_tensor'`). `clone()` waits for the collective and keeps the autograd edge. The hook is eager
    because only the block's `forward` is compiled, never its hooks.
    """
    if not any(isinstance(a, AsyncCollectiveTensor) for a in args):
        return None
    return tuple(a.clone() if isinstance(a, AsyncCollectiveTensor) else a for a in args)


def _model_buckets(units: Units) -> tuple:
    """Manual bucket plans for a whole-model graph: modules before the blocks one each, one per block,
    and the modules after the blocks together (the final norm and the output projection)."""
    return (*units.before, *units.blocks, tuple(units.after))


def _group_labels(dims: ParallelDims) -> dict[str, str]:
    """Process-group name -> `dp`, `cp` or `tp`, for every named dim of the mesh (and the flattened dp dims);
    the cp group is `dp` where it is also the parameters' shard group (no dp_shard dim beside it)."""

    def label(name: str) -> str:
        return "tp" if name == "tp" else "cp" if name == "cp" and dims.dp_shard > 1 else "dp"

    return {g.group_name: label(n) for n, g in dims.process_groups().items() if n != "pp"}


def _cost_model(c: Any, dims: ParallelDims) -> CostModel | None:
    """CPU figures for torch's runtime estimators (None on CUDA, where torch's own estimators work)."""
    if dims.world_mesh.device_type != "cpu":
        return None
    configured = CostModel.from_config(c.cpu_gflops, c.cpu_mem_gbps, c.comm_latency_us, c.comm_gbps)
    if c.cost_model == "config" or c.bucketing != "auto":
        return configured.quantised()
    return CostModel.measure((dims.dp_mesh or dims.param_mesh).get_group(0), fallback=configured)


# Inductor settings for a unit whose collectives our bucketing pass placed, decided from torch 2.13's code
# (scoped to the unit through `compile_fx(config_patches=...)`, never set globally):
# - `reorder_for_compute_comm_overlap=False` (torch's default, pinned): inductor's scheduler-level comm
#   reordering (raise all-gathers, sink waits) would move the collectives the pass already placed, and
#   with rank-aligned estimates it syncs over the world per graph. One scheduler owns the order: ours.
# - `reorder_for_peak_memory` stays on: with `insert_overlap_deps` (our inductor path) each collective's
#   overlap is pinned by `control_deps` data dependencies, which the peak-memory reordering respects, so
#   it cannot undo the overlap but still frees activations earlier; without reordering there is no order
#   of ours to undo.
# - `allow_buffer_reuse` stays on: torch 2.13 models collective safety in its IR ([Out-of-Place Collective
#   Safety] and [In-Place Collective Safety] in torch/_inductor/ir.py): a wait reads the collective's input
#   (so the input is not freed or reused while in flight), an in-place (bucketed `_out`) collective is a
#   two-step mutation of its buffer, and comm buffers are reused only by comm buffers. Turning reuse off
#   (what older SimpleFSDP recipes did against earlier inductors) would only raise peak memory.
BUCKETING_INDUCTOR_CONFIG: dict[str, Any] = {
    "reorder_for_compute_comm_overlap": False,
    "reorder_for_peak_memory": True,
    "allow_buffer_reuse": True,
}


class _Backend:
    """The torch.compile backend of one compile unit.

    `aot_eager`: AOTAutograd with `partitioner.Partitioner` (the min-cut partitioner; the default one
    ignores recompute tags) running the tagging pass on the joint graph, and the bucketing pass on the
    forward/backward graphs, which then run as plain FX graphs. `inductor`: `compile_fx` with the same
    two passes installed as `joint_custom_post_pass` / `post_grad_custom_post_pass` and the same
    partitioner as `custom_partitioner_fn` (cache-friendly, each with a stable `uuid()`). The
    AOTAutograd cache is off for this unit because a hit would skip the compilers that see the graphs;
    the FX graph cache (inductor's codegen, the expensive part) stays on, and on an FX cache hit the
    bucketing pass is replayed on a copy of the graph to count its collectives. `config_patches`: the
    run's own inductor settings (`parallelize.compile_options`), patched for this unit's compiles only.
    """

    def __init__(
        self,
        kind: str,
        tagging: RecomputeTagPass,
        bucketing: BucketingPass | None,
        report: CompileReport,
        unit: Unit,
        config_patches: dict[str, Any] | None = None,
    ):
        self.kind, self.tagging, self.bucketing, self.report, self.unit = kind, tagging, bucketing, report, unit
        self.config_patches = dict(config_patches or {})
        self._depth = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        with self._timed():
            if self.kind == "aot_eager":
                compiler = self._aot_eager_compile
                return aot_autograd(
                    fw_compiler=functools.partial(compiler, phase="forward"),
                    bw_compiler=functools.partial(compiler, phase="backward"),
                    inference_compiler=functools.partial(compiler, phase="inference"),
                    partition_fn=Partitioner(self.tagging, self.tagging.uuid()),
                    keep_inference_input_mutations=True,
                )(gm, example_inputs)
            from torch._inductor.compile_fx import compile_fx

            patches: dict[str, Any] = {
                "joint_custom_post_pass": self.tagging,
                "custom_partitioner_fn": Partitioner(None, self.tagging.uuid()),
            }
            if self.bucketing is not None:
                patches["post_grad_custom_post_pass"] = self.bucketing
                patches.update(BUCKETING_INDUCTOR_CONFIG)
            patches.update(self.config_patches)
            with torch._functorch.config.patch(enable_autograd_cache=False):
                return compile_fx(gm, example_inputs, inner_compile=self._inductor_compile, config_patches=patches)

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        """Add the wall time to the report, once per outermost compile (a lazily compiled backward is
        its own outermost compile)."""
        t0 = time.perf_counter()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self.report.compiled(time.perf_counter() - t0)

    def _aot_eager_compile(self, gm: torch.fx.GraphModule, example_inputs: Any, phase: str) -> Callable:
        with self._timed():
            before = graph_collectives(gm)
            if self.bucketing is not None:
                self.bucketing(gm.graph)
            if phase != "inference":
                self.report.record(self.unit, phase, before, graph_collectives(gm))
            return make_boxed_func(gm)

    def _inductor_compile(self, gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        from torch._inductor.compile_fx import compile_fx_inner

        phase = "backward" if kwargs.get("is_backward") else "inference" if kwargs.get("is_inference") else "forward"
        with self._timed():
            before = graph_collectives(gm)
            if self.bucketing is not None:
                self.bucketing.last_collectives = None
            compiled = compile_fx_inner(gm, example_inputs, **kwargs)
            if phase != "inference":
                after = before
                if self.bucketing is not None:
                    after = self.bucketing.last_collectives
                    if after is None:  # FX graph cache hit: the pass did not run on this graph
                        replay = copy.deepcopy(gm)
                        self.bucketing(replay.graph)
                        after = self.bucketing.last_collectives
                self.report.record(self.unit, phase, before, after)
            return compiled
