"""What a step of several backwards does with gradients and gathered weights, across its backwards.

A step runs one backward per microbatch (gradient accumulation, or a pipeline schedule's microbatches). Two
choices (`StepPolicy`) trade memory held for the step against collectives: gradients reduced
`per_microbatch` (only sharded gradients ever held) or `per_step` (accumulated unsharded, one reduction per
parameter after the last backward), and gathered weights `kept` for the step (`kept_gathers`) or regathered
by every forward. `step_candidates` lists what the config allows, most collectives saved first; `auto`
settings leave the choice to the memory estimate. Under pipeline parallelism torch's stage handles FSDP2 itself,
so only SimpleFSDP is handled here; a zero-bubble schedule reduces per microbatch, and compiled SimpleFSDP
keeps weights only with per_step. The policies, their rules and measurements: docs/parallelism.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from torch import nn

from titanlite.config import SPLIT_BACKWARD_SCHEDULES, JobConfig
from titanlite.parallelisms.step_policy import StepPolicy


def step_candidates(cfg: JobConfig, dp_mode: str, backwards: int) -> tuple[list[StepPolicy], list[str]]:
    """The policies `cfg` allows for a step of `backwards` backwards under data-parallel mode `dp_mode`,
    most collectives saved first: kept weights before regathered ones (they cost the compute dtype,
    unreduced gradients fp32), then per_step before per_microbatch; and why a choice is fixed, in words.

    Explicit settings are honoured: `gradient_reduction` per_step / per_microbatch fixes the reduction;
    `fsdp_reshard_after_forward` `default` / `always` regathers, `never` keeps (it holds every gathered
    weight from forward to backward already; keeping them between microbatches adds no peak)."""
    if backwards <= 1:
        return [StepPolicy()], []
    p = cfg.parallelism
    simple = p.dp_impl == "simple_fsdp"
    pipelined = p.pipeline_parallel_degree > 1
    why = []
    if p.gradient_reduction != "auto":
        reduce = [p.gradient_reduction == "per_step"]
        why.append(f"gradient_reduction = {p.gradient_reduction}")
    elif pipelined and simple and p.pipeline_parallel_schedule in SPLIT_BACKWARD_SCHEDULES:
        reduce = [False]
        why.append(f"the {p.pipeline_parallel_schedule} weight backward needs the parameters in the graph")
    elif pipelined and not simple:
        reduce = [True]
        why.append("torch's pipeline stage reduces FSDP2 once per schedule step")
    else:
        reduce = [True, False]
    if dp_mode == "replicate":
        keep = [False]
    elif p.fsdp_reshard_after_forward == "auto":
        keep = [True, False]
    else:
        keep = [p.fsdp_reshard_after_forward == "never"]
        why.append(f"fsdp_reshard_after_forward = {p.fsdp_reshard_after_forward}")
    policies = [StepPolicy(r, k) for k in keep for r in reduce]
    # `auto` never resolves to prefetch for a step of several backwards (`compile_scope`): only asked for.
    prefetch = cfg.compile.scope == "prefetch"
    if simple and cfg.compile.enable and "model" in cfg.compile.components and prefetch:
        # The eager prefetcher reduces each unit's sinks in every backward and gathers in every forward.
        why.append("compile.scope = prefetch reduces per microbatch and gathers every forward")
        return [StepPolicy()], why
    if simple and cfg.compile.enable and "model" in cfg.compile.components:
        # A compiled graph reads kept weights as inputs and routes their gradients to the unreduced
        # sinks; reducing them to the shards in each backward (per_microbatch) happens in eager code only.
        allowed = [q for q in policies if q.reduce_once or not q.keep_gathers]
        if len(allowed) < len(policies):
            why.append("compiled SimpleFSDP keeps gathered weights only with the per_step reduction")
        policies = allowed or [StepPolicy(r, False) for r in reduce]
    return policies, why


def _noop(last: bool) -> None:
    pass


@contextlib.contextmanager
def reduce_once(
    model: nn.Module, enabled: bool, pipelined: bool = False, keep: bool = False, backwards: int = 0
) -> Iterator[Callable[[bool], None]]:
    """The backwards of one step run inside; call the yielded `before_backward(last)` before each.

    With `enabled` (per_step and more than one backward), gradients are reduced once per parameter:
    by the last backward (FSDP2) or by SimpleFSDP's `step_reduction.unreduced`, whose buckets start in
    the last backward. With `keep` (kept gathers and more than one backward; the model was built with
    `kept_gathers.keep_for_step`), weights are gathered once: FSDP2 reshards after the last backward
    only, SimpleFSDP gathers through the step's cache, freed on leaving before the reduction
    completes. `pipelined`: the backwards are a pipeline schedule's, where torch's stage handles FSDP2
    itself, and `backwards` counts them (SimpleFSDP then starts each bucket's reduction in the last
    backward that completes it).
    """
    # Imported here: the step candidates above are the run plan's, which the launcher's preflight builds
    # without FSDP2, DTensor or SimpleFSDP's runtime.
    from torch.distributed.fsdp import FSDPModule

    from titanlite.parallelisms.data_parallel.kept_gathers import kept_gathers
    from titanlite.parallelisms.data_parallel.step_reduction import unreduced

    fsdp2 = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if fsdp2 and (pipelined or not (enabled or keep)):
        yield _noop
    elif fsdp2:
        root = fsdp2[0]  # model.modules() starts at the root; its setters recurse into every block

        def before_backward(last: bool) -> None:
            if enabled:
                root.set_requires_gradient_sync(last)
            if keep:
                root.set_reshard_after_backward(last)

        try:
            yield before_backward
        finally:
            root.set_requires_gradient_sync(True)
            root.set_reshard_after_backward(True)
    else:
        with contextlib.ExitStack() as stack:
            before_backward = stack.enter_context(unreduced(model, backwards)) if enabled else _noop
            stack.enter_context(kept_gathers(model, keep))
            yield before_backward
