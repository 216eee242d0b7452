"""What `compile.scope = auto` compiles, decided from the config alone (the run plan reads it before any
compiler is imported; `compiler.compile_scope` is the same answer from the built mesh).

    prefetch  fully checkpointed blocks under SimpleFSDP, transformer_block bucketing with reorder, no
              pipeline or expert parallelism, one backward per step: per-block graphs (compiled once
              for identical blocks) whose collectives are issued eagerly one block ahead (`prefetch.py`)
    model     the other bucketed SimpleFSDP runs: one graph whose scheduler prefetches and overlaps
              (its compile time grows with depth); what the prefetcher does not handle
    block     no bucketing, no graph passes, or expert parallelism (its dispatch breaks the graph)
"""

from __future__ import annotations

from titanlite.config import JobConfig


def with_passes(cfg: JobConfig, dp_enabled: bool) -> bool:
    """Whether SimpleFSDP's graph passes (and the compile report) apply: SimpleFSDP data parallelism
    (on: `dp_enabled`) under a backend that runs AOTAutograd."""
    return dp_enabled and cfg.parallelism.dp_impl == "simple_fsdp" and cfg.compile.backend in ("aot_eager", "inductor")


def accumulates(cfg: JobConfig, dp: int) -> bool:
    """Whether a step of `cfg` on `dp` data-parallel ranks accumulates several local batches
    (`training.global_batch_size` above local batch x dp; -1 means exactly that)."""
    t = cfg.training
    return t.global_batch_size > t.local_batch_size * dp


def resolve_scope(cfg: JobConfig, dp_enabled: bool, ep: int, pp: int, dp: int) -> str:
    """`cfg.compile.scope` with `auto` resolved (module docstring), for a run with data parallelism on or
    off (`dp_enabled`) over `dp` ranks, and expert and pipeline degrees `ep` and `pp`."""
    scope = cfg.compile.scope
    if scope != "auto":
        return scope
    if cfg.compile.bucketing == "none" or not with_passes(cfg, dp_enabled) or ep > 1:
        return "block"
    c, p = cfg.compile, cfg.parallelism
    prefetch = (
        c.bucketing == "transformer_block"
        and c.reorder
        and cfg.activation_checkpoint.mode == "full"
        and pp == 1
        and p.gradient_reduction != "per_step"
        and not accumulates(cfg, dp)
    )
    return "prefetch" if prefetch else "model"
