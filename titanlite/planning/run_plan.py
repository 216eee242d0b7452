"""The run plan: everything a run derives from its config and world size, computed once, with every rule
between config keys checked while computing it.

`RunPlan.build(cfg, world_size)` runs in the launcher's preflight before any rank starts (a bad combination is
one line, exit code 2); the ranks build the same plan and never re-derive a fact from the raw config. It holds
the batch (global batch, accumulation, virtual shards, backwards per step), the model (the family's spec, the
tokenizer, the shaped args), the layout (`ParallelDims`, pipeline stages and microbatches, loss parallel), the
precision, the step policies the config allows (the memory estimate picks one: `build.choose_step_policy`) and
the data sources, parsed once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from titanlite import torch_support
from titanlite.config import JobConfig
from titanlite.config.schema import shape_fields
from titanlite.data.data_source import DataSource
from titanlite.data.dataset import virtual_shard_count
from titanlite.data.tokenizer import Tokenizer, build_tokenizer
from titanlite.errors import ConfigError
from titanlite.fault_tolerance.rules import check as check_fault_tolerance
from titanlite.models.registry import ModelSpec, get_model_spec
from titanlite.parallelisms.activation_checkpoint import block_ac
from titanlite.parallelisms.layout import Layout
from titanlite.parallelisms.parallel_dims import ParallelDims
from titanlite.parallelisms.parallelize import check_rules, staging, step_candidates
from titanlite.parallelisms.step_policy import StepPolicy
from titanlite.planning.memory import StepChoice


def model_args(cfg: JobConfig, spec: ModelSpec, vocab_size: int) -> Any:
    """The flavor's args with the configured shape overrides and the vocabulary (`model.vocab_size`, else the
    tokenizer's `vocab_size`), checked before
    any rank starts (the family's `shape.check_args`; the training sequence fits); tensor-parallel divisibility
    is checked with the mesh (`ParallelDims`)."""
    m = cfg.model
    if m.flavor not in spec.flavors:
        raise ConfigError(f"config key 'model.flavor' = {m.flavor!r}: expected one of {', '.join(spec.flavors)}")
    overrides = {key: getattr(m, key) for key in shape_fields() if getattr(m, key)}
    for key in overrides:
        if key not in spec.shape.keys:
            raise ConfigError(f"config key 'model.{key}' does not apply to {m.name} models")
    if m.vocab_size and m.vocab_size < vocab_size:
        raise ConfigError(
            f"model.vocab_size {m.vocab_size:,} is smaller than the tokenizer's {vocab_size:,} ids: raise it, "
            "or set 0 (the tokenizer's size)"
        )
    args = dataclasses.replace(spec.flavors[m.flavor], **overrides, vocab_size=m.vocab_size or vocab_size)
    if m.moe_experts != "grouped_mm":
        if not hasattr(args, "grouped_mm"):
            raise ConfigError(f"config key 'model.moe_experts' does not apply to {m.name} models")
        args = dataclasses.replace(args, grouped_mm=False)
    shape = f"{m.flavor} with {', '.join(f'{k}={v}' for k, v in overrides.items())}" if overrides else m.flavor
    if why := spec.shape.check_args(args):
        raise ConfigError(f"model {shape}: {why}")
    if cfg.training.seq_len > args.max_seq_len:
        raise ConfigError(
            f"training.seq_len {cfg.training.seq_len} exceeds the model's max_seq_len {args.max_seq_len} ({shape})"
        )
    return args


def describe_shape(spec: ModelSpec, args: Any) -> str:
    """The final shape of the model, flavor and overrides applied, for the start-up log: the family's shape
    keys as the args resolve them (`resolved_shape`, see `models/registry.py`)."""
    values = spec.resolved_shape(args)
    return ", ".join(
        f"{key} {value:g}" if isinstance(value, float) else f"{key} {value}"
        for key, value in values.items()
        if value is not None
    )


def training_data(cfg: JobConfig) -> DataSource:
    """The training data, parsed (a malformed `hf://` path is one line): `training.dataset_path`, or for a
    mixture its first streamed source if it has one, else its first (the data is local only when every
    source is)."""
    if not cfg.training.datasets:
        return DataSource.parse(cfg.training.dataset_path)
    sources = [DataSource.parse(entry.path) for entry in cfg.training.datasets]
    return next((s for s in sources if not s.local), sources[0])


def replica_groups(cfg: JobConfig) -> int:
    """The job's replica groups: `fault_tolerance.group_size` when it is on, else 1."""
    ft = cfg.fault_tolerance
    return ft.group_size if ft.enable else 1


def check_combinations(cfg: JobConfig, data: DataSource) -> None:
    """The rules between keys that need neither the model nor the mesh: held-out data, and keys whose feature
    is off (never ignored). A parallelism's own rules are its unit's (`parallelism.ParallelismUnit.rules`)."""
    v = cfg.validation
    option = cfg.activation_checkpoint.selective_ac_option
    if option != "op" and cfg.activation_checkpoint.mode != "selective":
        raise ConfigError(
            f"activation_checkpoint.selective_ac_option {option} needs activation_checkpoint.mode selective "
            f"(the mode is {cfg.activation_checkpoint.mode})"
        )
    if v.enable and not v.dataset_path and not v.holdout_documents:
        raise ConfigError(
            "validation.enable needs held-out data: set validation.dataset_path or validation.holdout_documents"
        )
    if v.dataset_path and v.holdout_documents:
        raise ConfigError(
            "validation.holdout_documents and validation.dataset_path exclude each other: held-out training "
            "documents would be read by nothing"
        )
    if v.dataset_path and not v.enable:
        raise ConfigError(
            f"validation.dataset_path {v.dataset_path} needs validation.enable (without it nothing is evaluated)"
        )
    if v.holdout_documents and cfg.training.datasets:
        raise ConfigError(
            "validation.holdout_documents cannot hold documents out of a mixture (training.datasets); set "
            "validation.dataset_path to the held-out data"
        )
    if v.holdout_documents and not data.local:
        raise ConfigError(
            "validation.holdout_documents needs local training data; for hf:// data set validation.dataset_path "
            "to the dataset's own validation split (hf://name[:config]@validation)"
        )


def check_mask(cfg: JobConfig, spec: ModelSpec) -> None:
    """`model.attn_mask_type` needs a family whose forward takes positions and a mask (and a step that can
    hand them to every block: the units' rules)."""
    mask = cfg.model.attn_mask_type
    if mask not in spec.shape.attn_mask_types:
        raise ConfigError(f"model.attn_mask_type {mask} is not supported by model {spec.name} (only causal)")


def check_seed_world(cfg: JobConfig, world_size: int) -> None:
    """A seed checkpoint is written by one process (on a GPU node NGPU defaults to every GPU)."""
    if cfg.checkpoint.create_seed_checkpoint and world_size != 1:
        raise ConfigError(
            f"checkpoint.create_seed_checkpoint must run in a single process (world size {world_size}; "
            "NGPU=1 ./run_train.sh ...): the seed checkpoint is written unsharded and loads into any layout"
        )


def check_load_keys(cfg: JobConfig) -> None:
    """A key that chooses what to load is never ignored: `load_step` picks among the run's checkpoints, which
    are read with `checkpoint.enable` only, and `initial_load_in_hf` says what `initial_load_path` is."""
    c = cfg.checkpoint
    if c.load_step >= 0 and not c.enable:
        raise ConfigError(
            f"checkpoint.load_step {c.load_step} needs checkpoint.enable (without it no checkpoint is read)"
        )
    if c.initial_load_in_hf and not c.initial_load_path:
        raise ConfigError("checkpoint.initial_load_in_hf needs checkpoint.initial_load_path (the folder it describes)")


def check_local_checkpoints(cfg: JobConfig) -> None:
    """Node-local saves (`checkpoint.local_interval`) are taken with `checkpoint.enable` only (a restart
    compares them with the durable checkpoint), `local_folder` is read only with them, and an interval
    whose every save is of a step the durable checkpoint saves too would never be resumed from."""
    c = cfg.checkpoint
    if c.local_interval and not c.enable:
        raise ConfigError(
            f"checkpoint.local_interval {c.local_interval} needs checkpoint.enable (node-local saves "
            "complement the durable checkpoints)"
        )
    if c.local_folder and not c.local_interval:
        raise ConfigError(
            f"checkpoint.local_folder {c.local_folder!r} is set but checkpoint.local_interval is 0 (node-local "
            "saves are off)"
        )
    if c.local_interval and c.local_interval % c.interval == 0:
        raise ConfigError(
            f"checkpoint.local_interval {c.local_interval} is a multiple of checkpoint.interval {c.interval}: "
            "every node-local save would be of a step the durable checkpoint saves too (make it smaller)"
        )


@dataclass
class RunPlan:
    """Everything derived from the config and the world size alone (module docstring)."""

    cfg: JobConfig
    spec: ModelSpec
    tokenizer: Tokenizer
    model_args: Any
    dims: ParallelDims
    global_batch: int
    """Samples per optimizer step over every data-parallel rank (of this replica group: the job's
    `training.global_batch_size` over `fault_tolerance.group_size`)."""
    grad_accum: int
    """Local batches per optimizer step on each data-parallel rank."""
    virtual_shards: int
    """Virtual data shards: `training.dataset_virtual_shards`, or one per sample of the global batch."""
    data: DataSource
    """The training data (`training_data`)."""
    compile_passes: bool
    """Compilation installs SimpleFSDP's graph passes (`compile.check_compile`)."""
    pipeline: Any = None
    """The stage layout of the unit that cuts the model into stages (`parallelism.Stages.plan`: which blocks
    each stage holds, which stages a rank runs, the microbatches), else None."""
    step_candidates: list[StepPolicy] = dataclasses.field(init=False)
    """The step policies the config allows, most collectives saved first (`parallelize.step_candidates`)."""
    step_fixed: list[str] = dataclasses.field(init=False)
    """Why the step policy is not free, in words (explicit settings, the schedule, compilation)."""

    def __post_init__(self) -> None:
        self.step_candidates, self.step_fixed = step_candidates(self.cfg, self.dims, self.backwards_per_step)

    @classmethod
    def build(cls, cfg: JobConfig, world_size: int, *, tokenizer: Tokenizer | None = None, args: Any = None) -> RunPlan:
        """`tokenizer` and `args` replace the configured ones (the dry run without a tokenizer file, tests)."""
        torch_support.check(cfg, torch.__version__)
        check_seed_world(cfg, world_size)
        check_load_keys(cfg)
        check_local_checkpoints(cfg)
        data = training_data(cfg)
        check_combinations(cfg, data)
        spec = get_model_spec(cfg.model.name)
        check_mask(cfg, spec)
        tokenizer = tokenizer or build_tokenizer(cfg.model.tokenizer_path or None)
        args = args or model_args(cfg, spec, tokenizer.n_words)
        dims = ParallelDims.from_config(cfg.parallelism, world_size, spec.parallel.tp_divisible(args))
        if why := spec.shape.check_layout(args, dims):
            raise ConfigError(f"model {cfg.model.name}: {why}")
        check_rules(cfg, dims, spec, args)  # each parallelism's, with the other keys, the family and the mesh
        check_fault_tolerance(cfg, dims.pp, spec)
        t = cfg.training
        groups = replica_groups(cfg)
        per_step = dims.sequences(t.local_batch_size)  # one local batch on every data-parallel rank
        job_batch = t.global_batch_size if t.global_batch_size > 0 else per_step * groups
        if job_batch % (per_step * groups):
            of_groups = f" x replica groups {groups}" if groups > 1 else ""
            raise ConfigError(
                f"training.global_batch_size {job_batch} is not a multiple of "
                f"local_batch_size {t.local_batch_size} x data-parallel degree {dims.dp}{of_groups}"
            )
        global_batch = job_batch // groups
        staged = staging(cfg, dims)
        pipeline = staged.plan(cfg, dims, args) if staged is not None else None
        compile_passes = False
        if cfg.compile.enable:
            # Imported here: the compiler (torch._dynamo) is loaded by compiled runs only, so the launcher's
            # preflight of an eager run stays light.
            from titanlite.compile.compiler import check_compile

            full_ac = any(block_ac(cfg.activation_checkpoint, i) == "full" for i in range(args.n_layers))
            compile_passes = check_compile(cfg, dims, full_ac)
        accum = global_batch // per_step
        virtual_shards = virtual_shard_count(t.dataset_virtual_shards, job_batch)
        return cls(
            cfg, spec, tokenizer, args, dims, global_batch, accum, virtual_shards, data, compile_passes, pipeline
        )

    @property
    def replica_groups(self) -> int:
        """The job's replica groups (`fault_tolerance.group_size`; 1 without fault tolerance)."""
        return replica_groups(self.cfg)

    @property
    def data_dp_degree(self) -> int:
        """The data-parallel degree the data is split over: this run's, times the job's replica groups (group
        K reads what dp replica K of one run with `group_size` replicas would read)."""
        return self.dims.dp * self.replica_groups

    def data_dp_rank(self, dp_rank: int) -> int:
        """The index among `data_dp_degree` of this run's data-parallel rank `dp_rank`."""
        ft = self.cfg.fault_tolerance
        return (ft.replica_id if ft.enable else 0) * self.dims.dp + dp_rank

    @property
    def backwards_per_step(self) -> int:
        """Backwards of one step: the accumulation batches, times the schedule's microbatches under PP."""
        return self.grad_accum * (self.pipeline.microbatches if self.pipeline is not None else 1)

    @property
    def samples_per_shard(self) -> int:
        """Samples each virtual shard contributes to one global batch (of every replica group)."""
        return self.global_batch * self.replica_groups // self.virtual_shards

    @property
    def tokens_per_gpu_step(self) -> float:
        """Tokens of one optimizer step per GPU: the global batch's tokens over the world size. Tokens/s
        and MFU use it, so tensor-parallel ranks, which share one data-parallel replica's tokens, do not
        each count them (per-rank counting read tp times too high)."""
        return self.global_batch * self.cfg.training.seq_len / self.dims.world_size

    @property
    def loss_parallel(self) -> bool:
        """The loss runs on vocab-sharded logits (tensor parallelism, unless disabled)."""
        return self.dims.loss_parallel

    @property
    def param_dtype(self) -> torch.dtype:
        """Dtype of the gathered weights in forward and backward: mixed precision comes with the data-parallel
        plan (every run but pure tensor parallelism computes in it); without one, float32."""
        return torch_support.dtype(self.cfg.training.mixed_precision_param) if self.dims.dp_enabled else torch.float32

    @property
    def reduce_dtype(self) -> torch.dtype:
        """Dtype of the gradient reduction across data-parallel ranks (float32 without data parallelism)."""
        return torch_support.dtype(self.cfg.training.mixed_precision_reduce) if self.dims.dp_enabled else torch.float32

    def effective(self, policy: StepPolicy) -> StepPolicy:
        """What `policy` does in this run: holding anything across backwards needs data parallelism and
        more than one backward per step; otherwise there is nothing to hold."""
        if self.dims.dp_enabled and self.backwards_per_step > 1:
            return policy
        return StepPolicy()

    def layout(self, policy: StepPolicy | None = None, device_type: str = "cuda") -> Layout:
        """The memory estimate's view of this run under step policy `policy` (the trainer's build), on
        `device_type` (the dry run plans GPUs)."""
        p, t, dims = self.cfg.parallelism, self.cfg.training, self.dims
        effective = self.effective(policy or StepPolicy())
        return Layout(
            dims=dims,
            dp_mode=dims.dp_mode if dims.dp_enabled else None,
            dp_impl=p.dp_impl,
            compute_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            reshard=p.fsdp_reshard_after_forward,
            loss_parallel=self.loss_parallel,
            ac_mode=self.cfg.activation_checkpoint.mode,
            ac_option=self.cfg.activation_checkpoint.selective_ac_option,
            local_batch=t.local_batch_size,
            seq_len=t.seq_len,
            unreduced_grads=effective.reduce_once,
            keep_gathers=effective.keep_gathers,
            attn_mask=self.cfg.model.attn_mask_type,
            device_type=device_type,
            float8_gather=self.cfg.float8.enable and self.cfg.float8.all_gather,
        )

    def describe(self, step_choice: StepChoice) -> str:
        """The start-up log's line of what runs: AC, compilation, precision and the step's policy."""
        c, ac, t = self.cfg.compile, self.cfg.activation_checkpoint, self.cfg.training
        compiled = "eager"
        if c.enable:
            from titanlite.compile.compiler import compile_scope  # the compiler: compiled runs only

            scope = compile_scope(self.cfg, self.dims)
            compiled = f"compile {c.backend} ({', '.join(c.components)}; scope {scope}, bucketing {c.bucketing})"
        ac_text = ac.mode + (f" ({ac.selective_ac_option})" if ac.mode == "selective" else "")
        precision = (
            f"fp32 master weights, compute {t.mixed_precision_param}, reduce {t.mixed_precision_reduce}"
            if self.dims.dp_enabled
            else "float32 (no data-parallel plan)"
        )
        backwards, text = self.backwards_per_step, ""
        if self.dims.dp_enabled and backwards > 1:
            fsdp2_pp = self.pipeline is not None and self.cfg.parallelism.dp_impl == "fsdp2"
            if self.effective(step_choice.policy).reduce_once and fsdp2_pp and self.grad_accum > 1:
                text = "; reduced once per schedule step (torch's pipeline stage)"
            text = f"; step of {backwards} backwards: {step_choice.describe()}{text}"
        mask = self.cfg.model.attn_mask_type
        attention = "" if mask == "causal" else f"; attention {mask} (packed documents masked apart)"
        return f"AC {ac_text}; {compiled}; {precision}{text}{attention}"
