"""What a step of several backwards holds across them: its gradients unreduced, its gathered weights kept.

A step runs one backward per microbatch (the gradient-accumulation batches, or a pipeline schedule's
microbatches). Holding state across them trades memory held for the step against collectives: gradients
reduced once after the last backward instead of in every backward, weights gathered once for the step
instead of in every forward. `StepPolicy` is that choice, as a value the run plan lists, the memory estimate
chooses among (`planning.memory.first_fitting`) and the step context runs; the parallelism that holds the
state says which policies a run allows and what the chosen one changes in the model
(`parallelism.StepPolicies`, data parallelism's: `data_parallel/gradient_reduction.py`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepPolicy:
    """What a step of several backwards holds across them; one per run (`build.choose_step_policy`)."""

    reduce_once: bool = False
    """Gradients accumulate unsharded and are reduced once, after the step's last backward (per_step)."""
    keep_gathers: bool = False
    """Weights gathered by the step's first forward are kept until its last backward."""

    def describe(self) -> str:
        reduce = "per_step" if self.reduce_once else "per_microbatch"
        gathers = "kept for the step" if self.keep_gathers else "gathered again per microbatch"
        return f"gradient reduction {reduce}, weights {gathers}"
