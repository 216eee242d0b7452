"""Training metrics, written by rank 0: the console step line, metrics.jsonl, TensorBoard scalars and W&B.

`schema.py` declares every scalar once (its metrics.jsonl key, TensorBoard tag and W&B key) and the
records the trainer logs; `logger.py` turns a step or a held-out evaluation into the console line and
one row; `sinks.py` fans a row out to metrics.jsonl, TensorBoard and W&B, each output dropped with one
warning at its first failure; `runs.py` numbers and names the runs of a dump folder (runs.jsonl, the
TensorBoard folders); `peak_memory.py` measures the window's peak memory; `goodput.py` is the job's
goodput ledger (where its wall time went, over restarts and launches), `goodput_clock.py` rank 0's part
of it. The names other modules use are importable from `titanlite.metrics`; the MFU helpers (`mfu.py`)
too, for the benchmarks. They load on first use, so that the config's `metrics` section (`config.py`)
imports without torch.
"""

from __future__ import annotations

from titanlite.config.lazy_exports import lazy_exports

HOME, __all__, __getattr__ = lazy_exports(
    __name__,
    {
        "titanlite.metrics.logger": ("MetricsLogger", "clock"),
        "titanlite.metrics.mfu": ("mfu_pct", "peak_tflops"),
        "titanlite.metrics.peak_memory": ("MemoryMonitor",),
        "titanlite.metrics.schema": ("METRICS", "Metric", "StepStats", "ValidationResult"),
        "titanlite.metrics.sinks": ("check_wandb",),
    },
)
"""`HOME`: each name this package exports -> the module that defines it; `__all__`: those names."""
