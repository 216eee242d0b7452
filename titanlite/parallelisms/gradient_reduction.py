"""When gradients are reduced in a step of several backwards: in each of them, or once at the end.

A step runs one backward per microbatch: the gradient-accumulation batches, or a pipeline schedule's
microbatches. `parallelism.gradient_reduction` says what each data-parallel implementation does then:

    per_microbatch  every backward reduces every gradient (reduce-scatter; all-reduce for replicate):
                    k reductions per step, and only sharded gradients are ever held
    per_step        backwards accumulate each gradient unsharded on the rank; one reduction per parameter
                    after the last backward (SimpleFSDP: `simple_fsdp.unreduced`; FSDP2: gradient sync
                    off for all but the last backward). Costs the rank's unsharded gradients in the
                    reduce dtype for the step; saves (k - 1) reductions of every gradient

Under pipeline parallelism torch's pipeline stage already does `per_step` for FSDP2 itself, once per
schedule step (its microbatches; with several accumulation batches per step, once per batch), so there
only SimpleFSDP is handled here; config validation refuses `per_microbatch` for FSDP2 with PP rather than
ignore it. A zero-bubble schedule differentiates the parameters themselves in its weight backward, so
SimpleFSDP reduces per microbatch there (`auto`; `per_step` is refused).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from torch import nn
from torch.distributed.fsdp import FSDPModule

from titanlite.config import SPLIT_BACKWARD_SCHEDULES, Parallelism
from titanlite.parallelisms.simple_fsdp import unreduced


def reduces_once(p: Parallelism) -> bool:
    """Whether `parallelism.gradient_reduction` (`auto` resolved) reduces once per step. SimpleFSDP's
    once-per-step path routes gradients around the parameters, which a zero-bubble schedule's weight
    backward (`autograd.grad` of the parameters) would then not find: `auto` reduces per microbatch there."""
    if p.gradient_reduction != "auto":
        return p.gradient_reduction == "per_step"
    split = p.pipeline_parallel_degree > 1 and p.pipeline_parallel_schedule in SPLIT_BACKWARD_SCHEDULES
    return not (split and p.dp_impl == "simple_fsdp")


def _noop(last: bool) -> None:
    pass


@contextlib.contextmanager
def reduce_once(model: nn.Module, enabled: bool, pipelined: bool = False) -> Iterator[Callable[[bool], None]]:
    """The backwards of one step run inside; call the yielded `before_backward(last)` before each.

    With `enabled` (per_step and more than one backward), gradients are reduced once per parameter:
    by the last backward (FSDP2) or on leaving (SimpleFSDP). `pipelined`: the backwards are a pipeline
    schedule's, where torch's stage handles FSDP2 itself.
    """
    fsdp2 = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not enabled or (fsdp2 and pipelined):
        yield _noop
    elif fsdp2:
        root = fsdp2[0]  # model.modules() starts at the root; its setter recurses into every block

        def before_backward(last: bool) -> None:
            root.set_requires_gradient_sync(last)

        try:
            yield before_backward
        finally:
            root.set_requires_gradient_sync(True)
    else:
        with unreduced(model):
            yield _noop
