"""What the metrics are: every logged scalar declared once, and the records the trainer hands the logger.

Protocol: `METRICS` declares each scalar (name, group, display name, unit, description); the metrics.jsonl
key, the TensorBoard tag and its custom layout, and the W&B key all come from it, so a scalar has one name
everywhere. A step is logged from a `StepStats`, a held-out evaluation from a `ValidationResult`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from titanlite.metrics.goodput import BADPUT


@dataclass(frozen=True)
class ValidationResult:
    """One evaluation's result (`validation.Validator.run`), as `MetricsLogger.log_validation` records it."""

    loss: float
    """Mean token cross-entropy over the held-out batches and the data-parallel ranks."""
    seconds: float
    """Wall time of the evaluation (the trainer leaves it out of the training throughput)."""
    tokens: int
    """Tokens evaluated, all data-parallel ranks together."""

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))  # exp overflows a float beyond ~709


@dataclass
class StepStats:
    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: float
    """Tokens per GPU since the last log: the global batch's tokens over the world size."""
    elapsed: float
    data_time: float
    family: dict[str, float] = field(default_factory=dict)
    """The model family's own scalars (`ModelSpec.hooks.step_metrics`), by metric name."""
    tokens_seen: dict[str, int] = field(default_factory=dict)
    """A mixture's tokens per source since the run began (`tokens_seen_metric`), by source name."""
    straggler: dict[str, float] = field(default_factory=dict)
    """`straggler/slowest_rank` and `straggler/ratio` (`straggler.StragglerMeter`); none in a world of one."""
    goodput: dict[str, float] = field(default_factory=dict)
    """`goodput` and `badput/<category>` of the job so far (`goodput_clock.GoodputClock.metrics`)."""
    replicas: dict[str, float] = field(default_factory=dict)
    """`ft/quorum_size` and `ft/recoveries` of a replica group (`fault_tolerance.ReplicaGroup.metrics`)."""


@dataclass(frozen=True)
class Metric:
    """One logged scalar: its name (the metrics.jsonl key), chart group, display name, unit, description.

    The TensorBoard tag and the W&B key are `<group>/<name>`: one name per metric everywhere."""

    name: str
    group: str
    title: str
    unit: str
    description: str
    cuda_only: bool = False
    validation: bool = False
    """Written by a held-out evaluation (its own metrics.jsonl row), not by the step line."""
    family: bool = False
    """Reported by the model family (`ModelSpec.hooks.step_metrics`): logged only for a family that reports it."""
    straggler: bool = False
    """Measured across ranks (`straggler.StragglerMeter`): logged only in a run of several ranks that measures it."""
    replicas: bool = False
    """Of the job's replica groups (`fault_tolerance.enable`): logged only by a replica group."""

    @property
    def tag(self) -> str:
        """`<group>/<name>`; a name that begins with its group (`straggler/ratio`) is its own tag."""
        return self.name if self.name.startswith(f"{self.group}/") else f"{self.group}/{self.name}"

    @property
    def display_name(self) -> str:
        return f"{self.title} ({self.unit})" if self.unit else self.title


METRICS = (
    Metric("loss", "loss", "Training loss", "nats/token", "Cross-entropy of the step's batch, mean over dp ranks."),
    Metric("grad_norm", "loss", "Gradient norm", "", "Global L2 norm of the gradients, before clipping."),
    Metric("lr", "loss", "Learning rate", "", "The learning rate of the step (after warmup/decay)."),
    Metric(
        "tps",
        "throughput",
        "Throughput",
        "tokens/s per GPU",
        "The global batch's tokens over the world size and the step time (tp ranks share their tokens).",
    ),
    Metric("tflops", "throughput", "Achieved compute", "TFLOP/s per GPU", "Model FLOPs (6N + attention) per second."),
    Metric("mfu_pct", "throughput", "MFU", "% of peak", "Achieved TFLOP/s over the device's peak (see the log)."),
    Metric("mem_peak_gib", "memory", "Peak memory", "GiB", "CUDA max allocated, or CPU peak RSS, since last log."),
    Metric("mem_reserved_gib", "memory", "Peak reserved", "GiB", "CUDA caching allocator's peak reserved.", True),
    Metric("mem_pct", "memory", "Peak reserved", "% of GPU memory", "Peak reserved over the GPU's capacity.", True),
    Metric("data_pct", "time", "Data loading", "% of step time", "Time spent waiting for the next batch."),
    Metric("step_time_s", "time", "Step time", "s", "Wall time per optimizer step, averaged since the last log."),
    Metric(
        "straggler/slowest_rank",
        "straggler",
        "Slowest rank",
        "rank",
        "The rank with the most time of its own (not waiting in collectives) per step since the last log.",
        straggler=True,
    ),
    Metric(
        "straggler/ratio",
        "straggler",
        "Slowest rank's own time",
        "x the others' median",
        "The slowest rank's own time per step over the other ranks' median (1 when balanced).",
        straggler=True,
    ),
    Metric(
        "goodput",
        "goodput",
        "Goodput",
        "fraction",
        "Productive step time over the job's wall time, every launch and restart in the dump folder (goodput.jsonl).",
    ),
    *(Metric(f"badput/{c.name}", "badput", c.title, "s", f"{c.description} The job's total so far.") for c in BADPUT),
    Metric(
        "ft/quorum_size",
        "ft",
        "Quorum",
        "replica groups",
        "The replica groups that trained the step together (fewer than fault_tolerance.group_size during a failure).",
        replicas=True,
    ),
    Metric(
        "ft/recoveries",
        "ft",
        "Recoveries",
        "",
        "Times this group received a newer state from a live group, or sent one to a group that rejoined.",
        replicas=True,
    ),
    Metric(
        "ft/missed_steps",
        "ft",
        "Missed steps",
        "steps",
        "Steps the other groups trained while this group was away (skipped when it rejoined); goodput.jsonl too.",
        replicas=True,
    ),
    Metric(
        "ft/params_digest",
        "ft",
        "Parameters digest",
        "",
        "The bit patterns of every parameter summed, mod 2^24: equal in every group while their weights are equal.",
        replicas=True,
    ),
    Metric(
        "moe_aux_loss",
        "moe",
        "Router auxiliary loss",
        "",
        "Load-balancing loss of every rank's last microbatch pooled, before its coefficient (top_k when balanced).",
        family=True,
    ),
    Metric(
        "moe_load_imbalance",
        "moe",
        "Expert load imbalance",
        "max/mean",
        "Tokens of the busiest expert over the mean, all ranks since the last log, the worst MoE layer.",
        family=True,
    ),
    Metric(
        "moe_bias_spread",
        "moe",
        "Balancing bias spread",
        "",
        "max - min of a MoE layer's routing bias, the widest layer.",
        family=True,
    ),
    Metric(
        "val_loss",
        "validation",
        "Validation loss",
        "nats/token",
        "Mean cross-entropy of the held-out batches.",
        validation=True,
    ),
    Metric("val_ppl", "validation", "Validation perplexity", "", "exp(validation loss).", validation=True),
)
"""Every scalar the logger writes, in chart order; the TensorBoard custom layout is built from it."""


def tokens_seen_metric(source: str) -> Metric:
    """The cumulative tokens of a mixture's source (`training.datasets`): metrics.jsonl key
    `tokens_seen/<source>`, TensorBoard tag `data/tokens_seen/<source>`."""
    return Metric(
        f"tokens_seen/{source}",
        "data",
        f"Tokens seen: {source}",
        "tokens",
        f"Training tokens from the mixture's source {source} since the run began (all ranks, resumes included).",
    )


RENAMED = {"mfu": "mfu_pct", "data_time_pct": "data_pct"}
"""metrics.jsonl keys renamed to the shared names; the old keys are still written (same values) for one
release, then dropped."""
