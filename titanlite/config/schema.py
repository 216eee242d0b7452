"""The training configuration's schema: one dataclass per TOML section, every key typed, documented and,
for numbers, given its domain (`Range`) where it is declared.

This package imports no torch: the launcher, `--help` and the set-up scripts read the schema before a
torch process exists. What the values mean together (batch arithmetic, parallel layouts, which settings
combine) is the run plan's (`titanlite/planning/run_plan.py`); loading checks each key alone (`loading.py`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin

from titanlite.config.ranges import FRACTION, NON_NEGATIVE, POSITIVE, TIMEOUT, _range

DEFAULT_CONFIG = "train_configs/debug_model.toml"
"""The config of a run started without `--config` (relative to the working directory, the checkout)."""

SHAPE = {**NON_NEGATIVE, "shape": True}
"""Metadata of a `model.*` key overriding the flavor's shape (`shape_fields`)."""

DtypeName = Literal["float32", "bfloat16", "float16"]
"""The dtypes a config can name; `torch_support.dtype` maps them to torch's."""

GpuName = Literal["h100", "h100-96gb-500w", "h200", "a100", "b200"]
"""The GPU kinds the layout search can plan for; `titanlite.planning.gpus.GPU_KINDS` holds their figures."""


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
    """Model family: llama3, qwen3, qwen3_moe, or one registered with titanlite.models.registry.register_model."""
    flavor: str = "debugmodel"
    """The family's named shape (llama3: debugmodel, 1B, 8B, 70B, 405B; qwen3: debugmodel, debugmodel_tied,
    0.6B, 1.7B, 4B, 8B, 14B, 32B; qwen3_moe: debugmodel, 30B-A3B, 235B-A22B); the keys below override parts of it."""
    tokenizer_path: str = ""
    """A tiktoken-format BPE file (e.g. Llama 3's original/tokenizer.model), or a Hugging Face tokenizer.json
    (the file, or its folder: Qwen3's, Llama 3's; needs the hf extra); empty = the bundled 2k vocabulary."""
    vocab_size: int = field(default=0, metadata=NON_NEGATIVE)
    """Rows of the embedding and the output projection; 0 = the tokenizer's ids. A larger size pads them with
    rows no token uses, as published checkpoints do (Qwen3: 151,936 rows for its tokenizer's 151,669 ids),
    so that their weights load; smaller than the tokenizer is refused."""
    # Shape overrides of the flavor (0 = the flavor's value); checked before any rank starts against the
    # family's `shape.keys` (titanlite/models/registry.py).
    n_layers: int = field(default=0, metadata=SHAPE)
    """Transformer blocks; 0 = the flavor's."""
    dim: int = field(default=0, metadata=SHAPE)
    """Model (embedding) width; 0 = the flavor's. Must be a multiple of n_heads."""
    n_heads: int = field(default=0, metadata=SHAPE)
    """Attention (query) heads; 0 = the flavor's. Must divide dim."""
    n_kv_heads: int = field(default=0, metadata=SHAPE)
    """Key/value heads (grouped-query attention); 0 = the flavor's. Must divide n_heads."""
    ffn_dim: int = field(default=0, metadata=SHAPE)
    """Hidden width of the feed-forward (SwiGLU) layer, exactly; 0 = from the flavor and ffn_dim_multiplier."""
    ffn_dim_multiplier: float = field(default=0.0, metadata=SHAPE)
    """Scales the default feed-forward width 8/3 x dim (then rounded up to the flavor's multiple_of); 0 = the
    flavor's."""
    rope_theta: float = field(default=0.0, metadata=SHAPE)
    """RoPE base frequency; 0 = the flavor's."""
    max_seq_len: int = field(default=0, metadata=SHAPE)
    """The longest sequence the model supports (training.seq_len must fit); 0 = the flavor's."""
    num_experts: int = field(default=0, metadata=SHAPE)
    """Mixture of experts (qwen3_moe): experts per MoE layer; 0 = the flavor's."""
    top_k: int = field(default=0, metadata=SHAPE)
    """Mixture of experts: experts each token is routed to; 0 = the flavor's."""
    moe_ffn_dim: int = field(default=0, metadata=SHAPE)
    """Mixture of experts: hidden width of each expert's SwiGLU; 0 = the flavor's."""
    router_aux_loss_coef: float = field(default=0.0, metadata=SHAPE)
    """Mixture of experts: weight of the load-balancing loss in the training loss; 0 = the flavor's."""
    router_bias_update_rate: float = field(default=0.0, metadata=SHAPE)
    """Mixture of experts: aux-loss-free balancing, the step of each expert's routing bias after every
    optimizer step (DeepSeek-V3: 0.001); 0 = the flavor's (off in every built-in flavor)."""
    moe_experts: Literal["grouped_mm", "loop"] = "grouped_mm"
    """Mixture of experts: how the experts compute, as grouped GEMMs (`torch._grouped_mm`, where the widths
    and dtype fit; the loop elsewhere) or always as a loop over the experts (the reference, a benchmark
    baseline). The same weights either way: not part of the model's shape."""
    attn_mask_type: Literal["causal", "block_causal"] = "causal"
    """Attention over packed documents: `causal` (a token attends every earlier token of its sequence) or
    `block_causal` (only the earlier tokens of its own document; RoPE positions restart at each document).
    block_causal uses flex attention on CUDA and a dense mask on CPU; see docs/long_context.md."""


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
    implementation: Literal["foreach", "fused", "for-loop"] = "fused"
    """torch's AdamW kernel: `fused` (one kernel per step; on DTensor parameters one sharding decision
    where `foreach` takes one per grouped op: measured on the CPU debug model, a first step 0.06 s instead
    of 0.23 s and later steps 0.004 s instead of 0.02 s), `foreach` (grouped) or `for-loop`."""


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


SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
"""What a mixture source's name may be (it names metrics, `tokens_seen/<name>`, and checkpoint state)."""


@dataclass
class DatasetSource:
    """One source of a weighted mixture of training data (`training.datasets`)."""

    path: str = ""
    """Any form `training.dataset_path` takes; empty = the bundled corpus."""
    weight: float = 1.0
    """The source's share of the training tokens, relative to the other sources' weights (> 0)."""
    name: str = ""
    """What logs, metrics (`tokens_seen/<name>`) and checkpoints call the source; empty = the path's file stem."""

    @classmethod
    def parse(cls, text: str) -> DatasetSource:
        """The command-line form `[NAME=]PATH:WEIGHT` (the weight follows the last colon, so
        `hf://name:config:0.2` keeps its config; a name names a glob's or a shared file stem's source, as
        the TOML table's `name` does); ValueError when the weight is missing or not a number."""
        name, equals, rest = text.partition("=")
        if not (equals and SOURCE_NAME.fullmatch(name)):
            name, rest = "", text
        path, colon, weight = rest.rpartition(":")
        if not colon:
            raise ValueError(f"{text!r} has no weight (expected PATH:WEIGHT)")
        try:
            return cls(path=path, weight=float(weight), name=name)
        except ValueError:
            raise ValueError(f"{text!r}: the weight {weight!r} is not a number (expected PATH:WEIGHT)") from None


@dataclass
class Training:
    """Data, batch sizes, steps, precision and the run's seed."""

    dataset_path: str = ""
    """A file, directory or glob of .txt/.jsonl/.json (JSON lines)/.parquet, .gz or .zst compressed too (see
    titanlite/data/sources.py), or `hf://name[:config][@split]`; empty = bundled corpus."""
    datasets: list[DatasetSource] = field(default_factory=list)
    """A weighted mixture instead of `dataset_path`: TOML tables {path, weight, name}, or on the command line
    `[NAME=]PATH:WEIGHT,...`; each sample of a step comes from one source, in proportion to the weights."""
    dataset_text_field: str = "text"
    """The JSON/parquet field holding the text."""
    dataset_virtual_shards: int = field(default=0, metadata=NON_NEGATIVE)
    """Number of virtual data shards (0 = the global batch size); fixes the data order for any dp degree."""
    dataloader_num_workers: int = field(default=-1, metadata=_range(low=0, also=-1, also_means="auto"))
    """Data-loading worker processes per rank. -1 = auto: on CUDA up to 2 (as many as the layout allows:
    they must divide the microbatches per step), so tokenizing overlaps the GPU's work; on CPU 0, since
    workers would take cores from the ranks' own compute. Started by multiprocessing's fork server, never
    forked from the rank (which holds CUDA and NCCL state by then)."""
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
    mixed_precision_param: DtypeName = "bfloat16"
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
    """Held-out loss and perplexity during training (see titanlite/run/validation.py)."""

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
    """How the world of ranks is split: data parallel (FSDP, HSDP), context, tensor and pipeline parallel."""

    data_parallel_replicate_degree: int = field(default=1, metadata=POSITIVE)
    """Replicas of the sharded model (HSDP's outer dimension); 1 = plain FSDP."""
    data_parallel_shard_degree: int = field(
        default=-1, metadata=_range(low=0, low_open=True, also=-1, also_means="the rest")
    )
    """-1 = whatever the world size leaves after the other degrees."""
    tensor_parallel_degree: int = field(default=1, metadata=POSITIVE)
    """Ranks splitting each layer's matmuls (Megatron-style tensor parallelism)."""
    context_parallel_degree: int = field(default=1, metadata=POSITIVE)
    """Ranks splitting each sequence (context parallelism): each holds 1/cp of every sequence's tokens (two
    chunks, one from each end, to balance causal attention) and all-gathers the keys and values of the
    whole sequence in attention; parameters are sharded over data_parallel_shard_degree x cp. The mesh
    is (pp, dp_replicate, dp_shard, cp, tp). training.seq_len must be a multiple of 2 x cp."""
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
    `auto` = per_step when the memory plan fits comfortably (90% of the GPU), else per_microbatch; always
    per_microbatch for SimpleFSDP under a zero-bubble schedule (its split weight backward needs the
    parameters in the autograd graph)."""
    disable_loss_parallel: bool = False
    """Gather the vocabulary-sharded logits before the loss instead of a sharded cross-entropy (TP only)."""
    expert_parallel_degree: int = field(default=1, metadata=POSITIVE)
    """Ranks that split each MoE layer's experts, borrowed from dp_shard x cp (which it must divide); the
    experts are data-parallel over the rest. 1 = none. Qwen3-MoE, SimpleFSDP, TP on the dense parts; compiled
    blocks break the graph at the dispatch (docs/moe.md)."""
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
    export_dtype: DtypeName = "float32"
    """Dtype of model-only saves and exports."""
    create_seed_checkpoint: bool = False
    """Write the initialised model as step 0 and exit."""
    stop_on_save_error: bool = False
    """If a save fails (disk full, permissions), stop instead of warning and training on."""
    local_interval: int = field(default=0, metadata=NON_NEGATIVE)
    """Also save each rank's own state to node-local storage every this many steps, in the background
    (0 = off): a restart or relaunch resumes from the newest step every rank holds there, when newer than
    the durable checkpoint (docs/checkpoints.md#node-local-checkpoints)."""
    local_folder: str = ""
    """Node-local folder of those saves, relative to `job.dump_folder` (an absolute path on each node's own
    storage); empty = `/dev/shm/titanlite/<digest of the checkpoint folder's absolute path>`."""


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


@dataclass
class Float8:
    """Float8 training of the linear layers (torchao, the `float8` extra; docs/float8.md). The master
    weights, gradients and optimizer state stay in high precision; checkpoints hold those."""

    enable: bool = False
    """Convert the model's linear layers to float8 training."""
    recipe: Literal["tensorwise", "rowwise", "mxfp8"] = "tensorwise"
    """Scaling: `tensorwise` (one scale per tensor), `rowwise` (one per row: more accurate, slower; compiled
    with inductor's emulate_precision_casts) or `mxfp8` (blocks of 32, on GPUs with MX support)."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output", "auto_filter_small_kn"])
    """Linear layers left in high precision: those whose name contains an entry (comma-separated);
    `auto_filter_small_kn` also leaves those too small for float8 to gain (by shape). An entry that names
    no layer, or filters that leave none converted, is a warning; tied embeddings need `output` here."""
    all_gather: bool = False
    """Gather the weights in float8 (tensorwise): half the bytes of bf16, under every compile scope (the
    eager prefetcher's flat gathers too); not under tensor or pipeline parallelism."""
    emulate: bool = False
    """Emulate float8 matmuls in high precision (a CPU, or a GPU without float8): numerics only."""


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


@dataclass
class Comm:
    """Process-group timeouts, restarts, stop signals and the dry run's fake backend."""

    init_timeout_seconds: int = field(default=300, metadata=TIMEOUT)
    """Timeout of the process group's set-up and the first step (which includes compilation), and of the
    async checkpoint writer's collectives (which wait for every rank's file writes)."""
    train_timeout_seconds: int = field(default=100, metadata=TIMEOUT)
    """Timeout of each collective after the first step: a dead peer surfaces within it."""
    hang_timeout_seconds: float = field(default=60.0, metadata=_range(low=0, high=7 * 24 * 3600))
    """The launcher's hang watchdog (0 = off): when no rank of a node has finished a step for this long, it
    writes every rank's Python stacks to <dump_folder>/hang/<n>/, names the rank that stopped, then
    restarts the ranks (comm.max_restarts) or exits with code 5. Armed after each attempt's first step (not
    during start-up or the first compile); the window stretches to 3x the longest step seen, and to
    init_timeout_seconds during a checkpoint save or validation, so a healthy step never fires it. Below
    train_timeout_seconds it names a hang before the collective timeout ends the job without a name."""
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
class LayoutSearch:
    """The layout search (`--plan`, titanlite/tools/layout_search.py)."""

    gpu: GpuName = "h100"
    """GPU kind to plan for (titanlite/planning/gpus.py lists their figures and sources)."""
    top: int = field(default=5, metadata=POSITIVE)
    """Ranked layouts shown."""
    confirm: int = field(default=1, metadata=POSITIVE)
    """Fastest layouts planned again by the dry run itself (the best that fits is written)."""


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
    float8: Float8 = field(default_factory=Float8)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    comm: Comm = field(default_factory=Comm)
    layout_search: LayoutSearch = field(default_factory=LayoutSearch)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


SECTION_TYPES: dict[str, type] = typing.get_type_hints(JobConfig)
"""Section name -> its dataclass, in declaration order (resolved once: the annotations are strings)."""
FIELD_TYPES: dict[str, dict[str, Any]] = {s: typing.get_type_hints(cls) for s, cls in SECTION_TYPES.items()}
"""Section name -> {key: its type}: what every parse, override and check of a key reads."""


def _choice_fields() -> dict[str, tuple[str, ...]]:
    """`section.key` -> allowed values, for every `Literal[...]` field of the schema."""
    return {
        f"{section}.{key}": get_args(typ)
        for section, hints in FIELD_TYPES.items()
        for key, typ in hints.items()
        if get_origin(typ) is Literal
    }


# Allowed values of the choice fields, derived from their `Literal` types.
CHOICES: dict[str, tuple[str, ...]] = _choice_fields()


def sections() -> dict[str, type]:
    """Section name -> its dataclass, in declaration order."""
    return dict(SECTION_TYPES)


def all_keys() -> list[str]:
    """Every `section.key` of the schema, for suggesting the closest to a misspelt one."""
    return [f"{s}.{k}" for s, hints in FIELD_TYPES.items() for k in hints]


def shape_fields() -> list[str]:
    """The `model.*` keys that override a flavor's shape, in schema order."""
    return [f.name for f in dataclasses.fields(Model) if f.metadata.get("shape")]
