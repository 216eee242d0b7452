"""The `metrics` and `profiling` sections of the config: the step line, its outputs and the traces, beside the
logger and the profiler that read them (`logger.py`, `profiling.py`). Torch-free, importing only
`titanlite.config.ranges`: the config's schema (titanlite/config/schema.py) composes them into `JobConfig`,
which the launcher and `--help` read before any torch process exists."""

from __future__ import annotations

from dataclasses import dataclass, field

from titanlite.config.ranges import NON_NEGATIVE, POSITIVE, _range


@dataclass
class Metrics:
    """Console step line, metrics.jsonl, TensorBoard and Weights & Biases."""

    log_freq: int = field(default=10, metadata=POSITIVE)
    """Log metrics every this many steps (and at the first and last step)."""
    straggler_threshold: float = field(default=2.0, metadata=_range(low=1, also=0, also_means="off"))
    """A rank whose own time (not waiting in collectives) over the last three log steps exceeds the other
    ranks' median by this factor is named in the log as a straggler (0 = not measured). 2 = twice as slow:
    on a shared CPU host healthy ranks differ by up to about 1.6x; lower it on dedicated GPUs.
    `straggler/slowest_rank` and `straggler/ratio` are logged at every log step of a run of several ranks."""
    enable_tensorboard: bool = True
    """Write TensorBoard events under `job.dump_folder`/`save_tb_folder`."""
    save_tb_folder: str = "tb"
    """TensorBoard folder, relative to `job.dump_folder` (one sub-folder per start)."""
    disable_color_printing: bool = False
    """Never colour the step line (it is coloured only on a terminal anyway)."""
    peak_tflops: float = field(default=0.0, metadata=NON_NEGATIVE)
    """The device's peak TFLOP/s that MFU is computed against; 0 = the GPU's data-sheet bf16 peak, or on CPU a
    matmul rate measured once per machine and cached."""
    enable_wandb: bool = False
    """Also log the scalars to Weights & Biases (`pip install 'titanlite[wandb]'`; WANDB_MODE=offline works
    without network)."""
    wandb_project: str = "titanlite"
    """Weights & Biases project."""
    wandb_run_name: str = ""
    """Weights & Biases run name; empty = the dump folder's name."""


@dataclass
class Profiling:
    """torch.profiler traces and memory snapshots."""

    enable_profiling: bool = False
    """Record torch.profiler traces every `profile_freq` steps."""
    save_traces_folder: str = "profile_traces"
    """Trace folder, relative to `job.dump_folder`."""
    profile_freq: int = field(default=10, metadata=POSITIVE)
    """Profile one step every this many steps."""
    enable_memory_snapshot: bool = False
    """CUDA only: the allocator's history at each profiled step (and on OOM), for pytorch.org/memory_viz.
    On CPU, where there is none, each profiled step writes its allocated bytes over time instead
    (`rank<r>_memory_timeline.json`, see titanlite/metrics/profiling.py)."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Memory snapshot folder, relative to `job.dump_folder`."""
