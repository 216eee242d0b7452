"""The training configuration's schema: `JobConfig`, the list of the TOML sections, and the helpers that
read it. Each section is a dataclass, every key typed, documented and, for numbers, given its domain
(`Range`) where it is declared: beside the code that reads it (`titanlite/<package>/config.py`), or here
for the run's own sections (`job`, `training`, `comm`), which every layer reads.

This package imports no torch, nor do the section modules: the launcher, `--help` and the set-up scripts
read the schema before a torch process exists. What the values mean together (batch arithmetic, parallel
layouts, which settings combine) is the run plan's (`titanlite/planning/run_plan.py`); loading checks each
key alone (`loading.py`).
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin

from titanlite.checkpoint.config import Checkpoint
from titanlite.compile.config import Compile
from titanlite.config.ranges import NON_NEGATIVE, POSITIVE, TIMEOUT, DtypeName, _range
from titanlite.data.config import SOURCE_NAME, DatasetSource  # noqa: F401  SOURCE_NAME: loading reads it here
from titanlite.fault_tolerance.config import FaultTolerance
from titanlite.metrics.config import Metrics, Profiling
from titanlite.models.config import Model
from titanlite.parallelisms.config import ActivationCheckpoint, Parallelism
from titanlite.parallelisms.float8.config import Float8
from titanlite.planning.config import LayoutSearch
from titanlite.run.config import LRScheduler, Optimizer, Validation

DEFAULT_CONFIG = "train_configs/debug_model.toml"
"""The config of a run started without `--config` (relative to the working directory, the checkout)."""


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
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
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


def first_set_key(section: Any, keys: tuple[str, ...] | None = None) -> str | None:
    """The first of `keys` (default: every key) that a section's values hold away from its defaults, or None:
    the rules of a feature that is off name such a key, since setting it says the feature was meant."""
    defaults = type(section)()
    names = keys if keys is not None else tuple(f.name for f in dataclasses.fields(section))
    return next((key for key in names if getattr(section, key) != getattr(defaults, key)), None)


def shape_fields() -> list[str]:
    """The `model.*` keys that override a flavor's shape, in schema order."""
    return [f.name for f in dataclasses.fields(Model) if f.metadata.get("shape")]
