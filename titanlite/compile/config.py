"""The `compile` section of the config: torch.compile's keys and those of the passes that bucket and reorder
collectives, beside the compiler that reads them (`compiler.py`). Torch-free, importing only
`titanlite.config.ranges`: the config's schema (titanlite/config/schema.py) composes it into `JobConfig`, which
the launcher and `--help` read before any torch process exists."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from titanlite.config.ranges import NON_NEGATIVE, POSITIVE


@dataclass
class Compile:
    """torch.compile and the compiler passes that bucket and reorder collectives."""

    enable: bool = False
    """Compile with torch.compile."""
    backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    """torch.compile backend: `inductor` (generates kernels), `aot_eager` or `eager` (debugging)."""
    components: list[str] = field(default_factory=lambda: ["model", "loss"])
    """What is compiled: `model`, `loss` or both (comma-separated)."""
    bucketing: Literal["none", "auto", "transformer_block"] = "none"
    """`none`, `auto` (torch's overlap scheduler) or `transformer_block` (one bucket per block)."""
    reorder: bool = True
    """With bucketing: also move the bucketed collectives to overlap compute (prefetch all-gathers, defer
    reduce-scatter waits); off = bucketing only."""
    scope: Literal["auto", "block", "model", "prefetch"] = "auto"
    """`block` (compile each transformer block), `model` (one graph for the model's forward: the next
    block's gather overlaps this block's compute), `prefetch` (per-block graphs, SimpleFSDP's collectives
    issued eagerly one block ahead: full AC only) or `auto` (`compile.compile_scope`)."""
    cost_model: Literal["measure", "config"] = "measure"
    """CPU figures for `auto` bucketing's runtime estimates: `measure` (time a matmul, a copy and a gloo
    all-gather at start-up) or `config` (the four figures below). CUDA uses torch's GPU estimators."""
    cpu_gflops: float = field(default=128.0, metadata=POSITIVE)
    """Matmul GFLOP/s of one rank (defaults: a 2-core x86 VM with gloo on loopback, one thread per rank)."""
    cpu_mem_gbps: float = field(default=8.0, metadata=POSITIVE)
    """Copy bandwidth of one rank, GB/s."""
    comm_latency_us: float = field(default=256.0, metadata=NON_NEGATIVE)
    """Fixed cost of one collective, microseconds (also used by `measure` on a fake process group)."""
    comm_gbps: float = field(default=1.0, metadata=POSITIVE)
    """Per-rank collective bandwidth, GB/s (also used by `measure` on a fake process group)."""
