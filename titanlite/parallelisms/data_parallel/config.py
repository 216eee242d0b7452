"""Data parallelism's keys of the `parallelism` section: HSDP's degrees, the implementation, when gathered
weights are freed and when gradients are reduced. Torch-free, importing only `titanlite.config.ranges`:
`titanlite/parallelisms/config.py` composes it into the `parallelism` section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from titanlite.config.ranges import POSITIVE, _range


@dataclass
class DataParallel:
    """Data parallel: FSDP (SimpleFSDP or FSDP2) and HSDP."""

    data_parallel_replicate_degree: int = field(default=1, metadata=POSITIVE)
    """Replicas of the sharded model (HSDP's outer dimension); 1 = plain FSDP."""
    data_parallel_shard_degree: int = field(
        default=-1, metadata=_range(low=0, low_open=True, also=-1, also_means="the rest")
    )
    """-1 = whatever the world size leaves after the other degrees."""
    dp_impl: Literal["simple_fsdp", "fsdp2"] = "simple_fsdp"
    """`simple_fsdp` (this project's) or `fsdp2` (torch's fully_shard, the baseline)."""
    fsdp_reshard_after_forward: Literal["auto", "default", "always", "never"] = "auto"
    """Free gathered weights after forward and gather them again in backward: `default` (all blocks but the
    last), `always` or `never`. `auto` = `default`, but with several backwards per step the weights gathered
    by its first forward are kept for the whole step (one all-gather per parameter per step) when the memory
    plan fits comfortably (see titanlite/parallelisms/data_parallel/gradient_reduction.py); `never` keeps them too."""
    gradient_reduction: Literal["auto", "per_step", "per_microbatch"] = "auto"
    """With several backwards per step (gradient accumulation, pipeline microbatches): reduce each gradient
    once per step, holding the rank's gradients unsharded until then, or in every backward (sharded only).
    `auto` = per_step when the memory estimate fits comfortably (90% of the GPU), else per_microbatch; always
    per_microbatch for SimpleFSDP under a zero-bubble schedule (its split weight backward needs the
    parameters in the autograd graph)."""
