"""The training configuration: one dataclass per TOML section, loaded from a file, then CLI overrides.

Precedence is defaults < TOML file < command line. Every key is typed by its dataclass field, so an
unknown key or a value of the wrong type is reported in one line (naming the key, the file and the
closest valid key) as a `ConfigError`, before anything is built.

Command-line forms: `--section.key value`, `--section.key=value`, `--section.flag` / `--no-section.flag`
for booleans, comma-separated lists.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import json
import math
import os
import re
import sys
import textwrap
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args, get_origin

from titanlite.errors import ConfigError, run_cli

DEFAULT_CONFIG = "train_configs/debug_model.toml"
"""The config of a run started without `--config` (relative to the working directory, the checkout)."""

if TYPE_CHECKING:
    import torch

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


@dataclass(frozen=True)
class Range:
    """The domain of a numeric config key, kept on its field (`metadata=`) so `validate` checks every key
    from the schema itself: a new key declares its range where it is declared, and cannot be forgotten.

    `also` is one extra allowed value outside the interval (a sentinel such as -1 = "the rest").
    """

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    also: float | None = None
    also_means: str = ""

    def __contains__(self, value: float) -> bool:
        if value == self.also:
            return True
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def describe(self) -> str:
        """The domain in words: `positive`, `non-negative`, `in [0, 1)`, `>= 2`, with the sentinel first."""
        if self.high == math.inf and self.low == 0:
            text = "positive" if self.low_open else "non-negative"
        elif self.high == math.inf:
            text = f"{'>' if self.low_open else '>='} {_num(self.low)}"
        elif self.low == -math.inf:
            text = f"{'<' if self.high_open else '<='} {_num(self.high)}"
        else:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            text = f"in {left}{_num(self.low)}, {_num(self.high)}{right}"
        if self.also is None:
            return text
        means = f" ({self.also_means})" if self.also_means else ""
        return f"{_num(self.also)}{means} or {text}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _range(**kwargs: Any) -> dict[str, Range]:
    """Field metadata holding a `Range`."""
    return {"range": Range(**kwargs)}


POSITIVE = _range(low=0, low_open=True)
NON_NEGATIVE = _range(low=0)
FRACTION = _range(low=0, high=1)  # [0, 1]


@dataclass
class Job:
    """Where the run writes and how it is named."""

    config_file: str = ""
    """Path of the TOML file this config was read from (set by the loader)."""
    dump_folder: str = "./outputs"
    """Root of everything a run writes: metrics, TensorBoard events, checkpoints, traces."""
    description: str = ""
    """Free text describing the run (shown with the config; not used otherwise)."""
    print_config: bool = False
    """Print the merged config as JSON and exit without training."""


@dataclass
class Model:
    """Which model: a family, a named flavor, optional overrides of the flavor's shape, the tokenizer."""

    name: str = "llama3"
    """Model family: llama3, or one registered with titanlite.models.registry.register_model."""
    flavor: str = "debugmodel"
    """The family's named shape (llama3: debugmodel, 1B, 8B, 70B, 405B); the keys below override parts of it."""
    tokenizer_path: str = ""
    """A tiktoken-format BPE file (e.g. Llama 3's tokenizer.model); empty = the bundled 2k vocabulary."""
    # Shape overrides of the flavor (0 = the flavor's value); checked before any rank starts.
    n_layers: int = field(default=0, metadata=NON_NEGATIVE)
    """Transformer blocks; 0 = the flavor's."""
    dim: int = field(default=0, metadata=NON_NEGATIVE)
    """Model (embedding) width; 0 = the flavor's. Must be a multiple of n_heads."""
    n_heads: int = field(default=0, metadata=NON_NEGATIVE)
    """Attention (query) heads; 0 = the flavor's. Must divide dim."""
    n_kv_heads: int = field(default=0, metadata=NON_NEGATIVE)
    """Key/value heads (grouped-query attention); 0 = the flavor's. Must divide n_heads."""
    ffn_dim: int = field(default=0, metadata=NON_NEGATIVE)
    """Hidden width of the feed-forward (SwiGLU) layer, exactly; 0 = from the flavor and ffn_dim_multiplier."""
    ffn_dim_multiplier: float = field(default=0.0, metadata=NON_NEGATIVE)
    """Scales the default feed-forward width 8/3 x dim (then rounded up to the flavor's multiple_of); 0 = the
    flavor's."""
    rope_theta: float = field(default=0.0, metadata=NON_NEGATIVE)
    """RoPE base frequency; 0 = the flavor's."""
    max_seq_len: int = field(default=0, metadata=NON_NEGATIVE)
    """The longest sequence the model supports (training.seq_len must fit); 0 = the flavor's."""


@dataclass
class Optimizer:
    """The optimizer and its hyperparameters."""

    name: str = "AdamW"
    """The optimizer; AdamW is the one implemented."""
    lr: float = field(default=8e-4, metadata=NON_NEGATIVE)
    """Peak learning rate, reached after the warmup."""
    beta1: float = field(default=0.9, metadata=_range(low=0, high=1, high_open=True))
    """AdamW's first-moment decay."""
    beta2: float = field(default=0.95, metadata=_range(low=0, high=1, high_open=True))
    """AdamW's second-moment decay."""
    eps: float = field(default=1e-8, metadata=POSITIVE)
    """Positive: with 0, a parameter whose gradient is always zero divides 0 by 0 in AdamW."""
    weight_decay: float = field(default=0.1, metadata=NON_NEGATIVE)
    """Decoupled weight decay (AdamW)."""
    implementation: Literal["foreach", "fused", "for-loop"] = "foreach"
    """torch's AdamW kernel: `foreach` (grouped), `fused` (one kernel) or `for-loop`."""


@dataclass
class LRScheduler:
    """The learning-rate schedule: linear warmup, then an optional stable phase and a decay."""

    warmup_steps: int = field(default=10, metadata=NON_NEGATIVE)
    """Steps of linear warmup from 0 to `optimizer.lr`."""
    decay_ratio: float = field(default=1.0, metadata=FRACTION)
    """Fraction of the post-warmup steps spent decaying; < 1 gives warmup-stable-decay (WSD)."""
    decay_type: Literal["linear", "cosine", "sqrt"] = "linear"
    """Shape of the decay after warmup: `linear`, `cosine` or `sqrt`."""
    min_lr_factor: float = field(default=0.0, metadata=FRACTION)
    """The final learning rate as a fraction of `optimizer.lr`."""


@dataclass
class Training:
    """Data, batch sizes, steps, precision and the run's seed."""

    dataset_path: str = ""
    """A file, directory or glob of .txt/.jsonl/.json (JSON lines)/.parquet, .gz or .zst compressed too (see
    titanlite/data/sources.py), or `hf://name[:config][@split]`; empty = bundled corpus."""
    dataset_text_field: str = "text"
    """The JSON/parquet field holding the text."""
    dataset_virtual_shards: int = field(default=0, metadata=NON_NEGATIVE)
    """Number of virtual data shards (0 = the global batch size); fixes the data order for any dp degree."""
    dataloader_num_workers: int = field(default=-1, metadata=_range(low=0, also=-1, also_means="auto"))
    """Data-loading worker processes per rank. -1 = auto: on CUDA up to 2 (as many as the layout allows:
    they must divide the microbatches per step), so tokenizing overlaps the GPU's work; on CPU 0, since
    workers would take cores from the ranks' own compute."""
    local_batch_size: int = field(default=8, metadata=POSITIVE)
    """Sequences per rank per micro-batch."""
    global_batch_size: int = field(default=-1, metadata=_range(low=0, low_open=True, also=-1, also_means="local x dp"))
    """-1 = local batch size x data-parallel degree; larger values use gradient accumulation."""
    seq_len: int = field(default=2048, metadata=POSITIVE)
    """Tokens per sequence; at most the model's max_seq_len."""
    max_norm: float = field(default=1.0, metadata=NON_NEGATIVE)
    """Clip the global gradient norm to this; 0 = no clipping."""
    steps: int = field(default=10000, metadata=POSITIVE)
    """Optimizer steps of the whole run (the LR schedule spans them)."""
    seed: int = field(default=0, metadata=_range(low=0, high=2**64 - 1))
    """Seeds torch and Python (torch takes at most 64 bits)."""
    deterministic: bool = False
    """Use torch's deterministic algorithms (slower; bitwise repeatable runs)."""
    gc_freq: int = field(default=50, metadata=NON_NEGATIVE)
    """Run Python's garbage collector every this many steps (automatic collection is off); 0 = never."""
    mixed_precision_param: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Dtype of the gathered parameters in forward/backward, on every device and world size (master weights
    stay float32); the CPU configs set float32."""
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the gradient reduction across data-parallel ranks."""
    skip_nonfinite_steps: int = field(default=0, metadata=NON_NEGATIVE)
    """How many optimizer steps with a non-finite loss or grad norm may be skipped; 0 = stop on the first."""
    allow_dataset_change: bool = False
    """Resume from a checkpoint trained on other data (its fingerprint differs): warn and read the new dataset
    from its beginning. Off, such a resume stops: the saved data positions would point into other files."""


@dataclass
class Validation:
    """Held-out loss and perplexity during training (see titanlite/validation.py)."""

    enable: bool = False
    """Evaluate the held-out loss every `freq` steps (off: training only)."""
    dataset_path: str = ""
    """Held-out data, in any form `training.dataset_path` takes; empty = the training data's held-out tail
    (`holdout_documents`)."""
    holdout_documents: int = field(default=0, metadata=NON_NEGATIVE)
    """The last N documents of the local training data, which training then never reads (whether validation is
    on or not, so turning it on or off does not change the training stream); validation reads them."""
    freq: int = field(default=500, metadata=POSITIVE)
    """Evaluate after every `freq`-th optimizer step."""
    steps: int = field(default=10, metadata=POSITIVE)
    """Batches per evaluation; every evaluation reads the same batches from the held-out data's start."""
    local_batch_size: int = field(default=8, metadata=POSITIVE)
    """Sequences per batch and data-parallel rank (of `training.seq_len` tokens)."""


SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble",)
"""Pipeline schedules that run each backward as an input half and a weight half (zero bubble)."""


@dataclass
class Parallelism:
    """How the world of ranks is split: data parallel (FSDP, HSDP) and tensor parallel."""

    data_parallel_replicate_degree: int = field(default=1, metadata=POSITIVE)
    """Replicas of the sharded model (HSDP's outer dimension); 1 = plain FSDP."""
    data_parallel_shard_degree: int = field(
        default=-1, metadata=_range(low=0, low_open=True, also=-1, also_means="the rest")
    )
    """-1 = whatever the world size leaves after the other degrees."""
    tensor_parallel_degree: int = field(default=1, metadata=POSITIVE)
    """Ranks splitting each layer's matmuls (Megatron-style tensor parallelism)."""
    dp_impl: Literal["simple_fsdp", "fsdp2"] = "simple_fsdp"
    """`simple_fsdp` (this project's) or `fsdp2` (torch's fully_shard, the baseline)."""
    fsdp_reshard_after_forward: Literal["auto", "default", "always", "never"] = "auto"
    """Free gathered weights after forward and gather them again in backward: `default` (all blocks but the
    last), `always` or `never`. `auto` = `default`, but with several backwards per step the weights gathered
    by its first forward are kept for the whole step (one all-gather per parameter per step) when the memory
    plan fits comfortably (see titanlite/parallelisms/gradient_reduction.py); `never` keeps them too."""
    gradient_reduction: Literal["auto", "per_step", "per_microbatch"] = "auto"
    """With several backwards per step (gradient accumulation, pipeline microbatches): reduce each gradient
    once per step, holding the rank's gradients unsharded until then, or in every backward (sharded only).
    `auto` = per_step when the memory plan fits comfortably (90% of the GPU), else per_microbatch; always
    per_microbatch for SimpleFSDP under a zero-bubble schedule (its split weight backward needs the
    parameters in the autograd graph)."""
    disable_loss_parallel: bool = False
    """Gather the vocabulary-sharded logits before the loss instead of a sharded cross-entropy (TP only)."""
    pipeline_parallel_degree: int = field(default=1, metadata=POSITIVE)
    """Pipeline stages' rank groups: the outermost mesh dim (pp, dp_replicate, dp_shard, tp). 1 = no PP."""
    pipeline_parallel_schedule: Literal["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble"] = "1F1B"
    """torch.distributed.pipelining's schedule; the interleaved ones hold several stages per rank."""
    pipeline_parallel_microbatch_size: int = field(default=1, metadata=POSITIVE)
    """Samples per pipeline microbatch; the local batch must be a multiple of it."""
    pipeline_parallel_stages_per_rank: int = field(
        default=-1, metadata=_range(low=0, low_open=True, also=-1, also_means="by schedule")
    )
    """-1 = 1 for GPipe and 1F1B, 2 for the interleaved schedules."""
    pipeline_parallel_split_points: list[int] = field(default_factory=list)
    """Block indices at which stages 1, 2, ... begin (stages-1 ascending values); empty = balanced, counting
    the embedding and the output as one block each (the first and last stage take one block fewer)."""


@dataclass
class Checkpoint:
    """Saving, resuming and initial weights."""

    enable: bool = False
    """Save checkpoints and resume from the newest one at start-up."""
    folder: str = "checkpoint"
    """Checkpoint folder, relative to `job.dump_folder`."""
    interval: int = field(default=500, metadata=POSITIVE)
    """Save every this many steps (and at the last step)."""
    keep_latest_k: int = field(default=0, metadata=NON_NEGATIVE)
    """Keep only the newest k complete checkpoints (0 = keep all)."""
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """`disabled` (save blocks the step), `async` (save in the background) or `async_with_pinned_mem`."""
    load_step: int = field(default=-1, metadata=_range(low=0, also=-1, also_means="the newest"))
    """-1 = the newest complete checkpoint."""
    initial_load_path: str = ""
    """A checkpoint folder to start from when the run has none of its own (fine-tuning)."""
    initial_load_in_hf: bool = False
    """`initial_load_path` is a Hugging Face folder (safetensors + config.json)."""
    last_save_model_only: bool = False
    """The final save keeps only the model weights (no optimizer or data state)."""
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of model-only saves and exports."""
    create_seed_checkpoint: bool = False
    """Write the initialised model as step 0 and exit."""
    stop_on_save_error: bool = False
    """If a save fails (disk full, permissions), stop instead of warning and training on."""


@dataclass
class ActivationCheckpoint:
    """Recomputing activations in backward to save memory."""

    mode: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward: `none`, `full` (every block) or `selective`."""
    selective_ac_option: str = "op"
    """`op` (save attention and every other matmul output, recompute the rest: TorchTitan's rule),
    `op_all_mm` (save every matmul output) or an integer k (every k-th block fully); see
    titanlite/parallelisms/activation_checkpoint.py."""


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
    scope: Literal["auto", "block", "model"] = "auto"
    """`block` (compile each transformer block), `model` (one graph for the model's forward: the next
    block's gather overlaps this block's compute) or `auto` (`model` with SimpleFSDP bucketing, else `block`)."""
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


@dataclass
class Metrics:
    """Console step line, metrics.jsonl, TensorBoard and Weights & Biases."""

    log_freq: int = field(default=10, metadata=POSITIVE)
    """Log metrics every this many steps (and at the first and last step)."""
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
    (`rank<r>_memory_timeline.json`, see titanlite/profiling.py)."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Memory snapshot folder, relative to `job.dump_folder`."""


@dataclass
class Comm:
    """Process-group timeouts, restarts, stop signals and the dry run's fake backend."""

    init_timeout_seconds: int = field(default=300, metadata=POSITIVE)
    """Timeout of the process group's set-up and the first step (which includes compilation)."""
    train_timeout_seconds: int = field(default=100, metadata=POSITIVE)
    """Timeout of each collective after the first step: a dead peer surfaces within it."""
    max_restarts: int = field(default=0, metadata=NON_NEGATIVE)
    """Restarts of all ranks after a crash (not after bad input or divergence); MAX_RESTARTS overrides it."""
    stop_grace_seconds: float = field(default=120.0, metadata=POSITIVE)
    """After a stop signal (SIGTERM, SIGUSR1, Ctrl-C) the launcher waits this long for the ranks to reach a
    step boundary and save, then kills them. Keep it below the scheduler's own grace period (SLURM
    KillWait, Kubernetes terminationGracePeriodSeconds), or that one kills the launcher first."""
    mode: Literal["default", "fake_backend"] = "default"
    """`fake_backend` = a dry run on a fake process group."""
    fake_world_size: int = field(default=0, metadata=NON_NEGATIVE)
    """Dry run: the world size to plan for; 0 = NGPU x NNODES as run_train.sh computes it (WORLD_SIZE)."""
    fake_rank: int = field(default=0, metadata=NON_NEGATIVE)
    """Dry run: the rank whose shards are reported (rank 0 holds the larger part of uneven shards)."""
    fake_gpu_memory_gib: float = field(default=80.0, metadata=POSITIVE)
    """Dry run: memory of one GPU in GiB (80: H100/A100 80GB; H200 141, B200 180, MI300X 192)."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    validation: Validation = field(default_factory=Validation)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    comm: Comm = field(default_factory=Comm)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _choice_fields() -> dict[str, tuple[str, ...]]:
    """`section.key` -> allowed values, for every `Literal[...]` field of the schema."""
    return {
        f"{s}.{k}": get_args(t)
        for s, cls in typing.get_type_hints(JobConfig).items()
        for k, t in typing.get_type_hints(cls).items()
        if get_origin(t) is Literal
    }


# Allowed values of the choice fields, derived from their `Literal` types.
CHOICES: dict[str, tuple[str, ...]] = _choice_fields()

DTYPES: dict[str, torch.dtype]
"""The one map from the config's dtype names to torch dtypes (built on first use: reading and checking a
config imports no torch, so the launcher reports a mistyped key before spending seconds on that import)."""


@functools.cache
def _dtypes() -> dict[str, torch.dtype]:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def __getattr__(name: str) -> Any:
    if name == "DTYPES":
        return _dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _sections() -> dict[str, type]:
    """Section name -> its dataclass, in declaration order."""
    return typing.get_type_hints(JobConfig)


def _all_keys() -> list[str]:
    return [f"{s}.{k}" for s, cls in _sections().items() for k in typing.get_type_hints(cls)]


def _suggest(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else ""


def _coerce(key: str, value: Any, typ: Any, origin: str) -> Any:
    """Convert a TOML or command-line value to the field's type, or raise a one-line ConfigError."""
    where = f" in {origin}" if origin else ""
    if get_origin(typ) is Literal:
        typ = str  # the value is checked against the choices by `validate`
    if get_origin(typ) is list:
        (item,) = get_args(typ)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"config key '{key}'{where}: expected a list, got {value!r}")
        return [_coerce(key, v, item, origin) for v in value]
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif typ is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"config key '{key}'{where}: expected {getattr(typ, '__name__', typ)}, got {value!r}")


def _set(cfg: JobConfig, key: str, value: Any, origin: str) -> None:
    where = f" in {origin}" if origin else ""
    section, _, name = key.partition(".")
    sections = _sections()
    if section not in sections:
        raise ConfigError(f"unknown config section '{section}'{where}{_suggest(section, list(sections))}")
    hints = typing.get_type_hints(sections[section])
    if not name or name not in hints:
        raise ConfigError(f"unknown config key '{key}'{where}{_suggest(key, _all_keys())}")
    setattr(getattr(cfg, section), name, _coerce(key, value, hints[name], origin))


def load_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"invalid TOML in {path}: {e}") from None


def apply_dict(cfg: JobConfig, data: dict[str, Any], origin: str) -> None:
    for section, body in data.items():
        if not isinstance(body, dict):
            raise ConfigError(
                f"config entry '{section}' in {origin} is not a [section]{_suggest(section, list(_sections()))}"
            )
        for name, value in body.items():
            _set(cfg, f"{section}.{name}", value, origin)


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """Turn `--a.b v`, `--a.b=v`, `--a.flag`, `--no-a.flag` into (key, raw value) pairs."""
    bool_keys = {
        f"{s}.{k}" for s, cls in _sections().items() for k, t in typing.get_type_hints(cls).items() if t is bool
    }
    out: list[tuple[str, Any]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected command-line argument '{arg}' (overrides look like --section.key value)")
        key, eq, value = arg[2:].partition("=")
        if eq:
            out.append((key, value))
        elif key.startswith("no-") and key[3:] in bool_keys:
            out.append((key[3:], False))
        elif key in bool_keys and (i + 1 == len(args) or args[i + 1].startswith("--")):
            out.append((key, True))
        elif i + 1 < len(args):
            out.append((key, args[i + 1]))
            i += 1
        else:
            raise ConfigError(f"command-line option '--{key}' needs a value")
        i += 1
    return out


def load_config(argv: list[str], default_config: str = "") -> JobConfig:
    """Build the JobConfig from `--config PATH` (or `default_config`) and the remaining overrides."""
    argv = list(argv)
    path = default_config
    for i, arg in enumerate(argv):
        if arg == "--config" or arg == "--job.config_file":
            if i + 1 >= len(argv):
                raise ConfigError(f"{arg} needs a path")
            path = argv[i + 1]
            del argv[i : i + 2]
            break
        if arg.startswith("--config=") or arg.startswith("--job.config_file="):
            path = arg.split("=", 1)[1]
            del argv[i]
            break
    cfg = JobConfig()
    if path:
        apply_dict(cfg, load_toml(path), path)
        cfg.job.config_file = path
    for key, value in parse_overrides(argv):
        _set(cfg, key, value, "the command line")
    validate(cfg)
    return cfg


def _numeric_values(cfg: JobConfig) -> Iterator[tuple[str, float, Range | None]]:
    """(`section.key`, value, its `Range` or None) for every int and float field of the schema."""
    for section, cls in _sections().items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if hints[f.name] in (int, float):
                yield f"{section}.{f.name}", getattr(getattr(cfg, section), f.name), f.metadata.get("range")


def validate(cfg: JobConfig) -> None:
    """Check values that the types alone cannot: choices, every numeric key's `Range`, finite floats."""
    for key, allowed in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in allowed:
            raise ConfigError(f"config key '{key}' = {value!r}: expected one of {', '.join(allowed)}")
    for key, value, domain in _numeric_values(cfg):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"config key '{key}' must be a finite number, got {value}")
        if domain is not None and value not in domain:
            raise ConfigError(f"config key '{key}' must be {domain.describe()}, got {value}")
    if cfg.optimizer.name != "AdamW":
        raise ConfigError(f"config key 'optimizer.name' = {cfg.optimizer.name!r}: expected AdamW")
    option = cfg.activation_checkpoint.selective_ac_option
    if option not in ("op", "op_all_mm") and not (option.isdigit() and int(option) > 0):
        raise ConfigError(
            f"config key 'activation_checkpoint.selective_ac_option' = {option!r}: "
            "expected 'op', 'op_all_mm' or a positive integer"
        )
    v = cfg.validation
    if v.enable and not v.dataset_path and not v.holdout_documents:
        raise ConfigError(
            "validation.enable needs held-out data: set validation.dataset_path or validation.holdout_documents"
        )
    if v.dataset_path and v.holdout_documents:
        raise ConfigError(
            "validation.holdout_documents and validation.dataset_path exclude each other: held-out training "
            "documents would be read by nothing"
        )
    if v.holdout_documents and cfg.training.dataset_path.startswith("hf://"):
        raise ConfigError(
            "validation.holdout_documents needs local training data; for hf:// data set validation.dataset_path "
            "to the dataset's own validation split (hf://name[:config]@validation)"
        )
    p = cfg.parallelism
    if v.enable and p.pipeline_parallel_degree > 1:
        raise ConfigError(
            "validation.enable is not supported with pipeline_parallel_degree > 1 yet (held-out batches would "
            "have to run through the pipeline schedule); turn one of them off"
        )
    if p.pipeline_parallel_degree > 1 and p.dp_impl == "fsdp2" and p.gradient_reduction == "per_microbatch":
        raise ConfigError(
            "parallelism.gradient_reduction per_microbatch is not available for fsdp2 with pipeline parallelism: "
            "torch's pipeline stage reduces FSDP2 gradients once per schedule step (use per_step or simple_fsdp)"
        )
    if (
        p.pipeline_parallel_degree > 1
        and p.dp_impl == "simple_fsdp"
        and p.pipeline_parallel_schedule in SPLIT_BACKWARD_SCHEDULES
        and p.gradient_reduction == "per_step"
    ):
        raise ConfigError(
            f"parallelism.gradient_reduction per_step is not available for simple_fsdp with the "
            f"{p.pipeline_parallel_schedule} schedule: its weight backward differentiates the parameters, which "
            "the once-per-step path takes out of the autograd graph (use auto or per_microbatch)"
        )
    if (
        p.pipeline_parallel_degree > 1
        and p.pipeline_parallel_schedule in SPLIT_BACKWARD_SCHEDULES
        and (cfg.compile.enable and "model" in cfg.compile.components)
    ):
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule {p.pipeline_parallel_schedule} cannot run compiled blocks: "
            "its split input/weight backward would run each compiled block's one backward node twice "
            "(use Interleaved1F1B, or compile.components = loss)"
        )
    if p.pipeline_parallel_degree == 1 and (
        p.pipeline_parallel_split_points or p.pipeline_parallel_stages_per_rank != -1
    ):
        raise ConfigError(
            "config keys 'parallelism.pipeline_parallel_split_points' and '...stages_per_rank' need "
            "pipeline_parallel_degree > 1"
        )
    for component in cfg.compile.components:
        if component not in ("model", "loss"):
            raise ConfigError(f"config key 'compile.components' has {component!r}: expected model and/or loss")


# --- help: the schema in words ----------------------------------------------------------------------------

USAGE = (
    "usage: ./run_train.sh [--config FILE] [--dry-run] [--section.key VALUE | --section.key=VALUE | "
    "--section.flag | --no-section.flag ...]"
)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """A dataclass's attribute docstrings (the string under each field), read from its source: Python
    keeps them nowhere at run time, and the schema's own docstrings are the one place keys are described."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def first_sentence(text: str) -> str:
    """The first sentence of a docstring's first paragraph, on one line."""
    para = " ".join(text.split("\n\n")[0].split())
    return re.split(r"(?<!e\.g)(?<!i\.e)\.\s+(?=[A-Z`(])", para, maxsplit=1)[0].rstrip(".") + "."


def describe_type(typ: Any, domain: Range | None) -> str:
    """A field's type for people: `int, positive`, `one of a|b`, `list of str`."""
    if get_origin(typ) is Literal:
        return "one of " + "|".join(get_args(typ))
    if get_origin(typ) is list:
        return f"list of {get_args(typ)[0].__name__} (comma-separated)"
    name = getattr(typ, "__name__", str(typ))
    return f"{name}, {domain.describe()}" if domain is not None else name


def help_text() -> str:
    """Every section and key of the schema with its type, default and one-line description."""
    out = [
        USAGE,
        "",
        "Train a model from a TOML config (default train_configs/debug_model.toml) plus overrides of any key below;",
        "bad input stops with one line and exit code 2 before any process starts. --dry-run plans memory on a fake",
        "process group instead of training. Environment: NGPU, NNODES, RDZV_ENDPOINT, LOG_RANK, MAX_RESTARTS",
        "(see the header of run_train.sh). --job.print_config prints the merged config and exits.",
    ]
    for section, cls in _sections().items():
        hints, docs = typing.get_type_hints(cls), field_docs(cls)
        out += ["", f"[{section}]  {first_sentence(inspect.getdoc(cls) or '')}"]
        for f in dataclasses.fields(cls):
            if f.name == "config_file":
                continue  # set by --config
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
            shown = ",".join(default) if isinstance(default, list) else json.dumps(default)
            typ = describe_type(hints[f.name], f.metadata.get("range"))
            out.append(f"  --{section}.{f.name} ({typ}; default {shown})")
            out.append(f"      {first_sentence(docs.get(f.name, ''))}")
    return "\n".join(out)


def help_requested(argv: list[str]) -> bool:
    return any(a in ("-h", "--help") for a in argv)


def main(argv: list[str]) -> int:
    """`python -m titanlite.config [--help] [--config FILE] [overrides]`: the schema, or the merged config."""
    text = help_text() if help_requested(argv) else load_config(argv, default_config=DEFAULT_CONFIG).to_json()
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `--help | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
