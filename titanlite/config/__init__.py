"""The training configuration: the schema (`schema.py`), loading from TOML and the command line with each
key checked alone (`loading.py`), and the help generated from the schema (`help.py`).

Torch-free on purpose: the launcher's shell, `--help` and the set-up scripts read the config before (or
without) a torch process. Rules between keys, and everything derived from the config with the world size
and the model, are the run plan's (`titanlite/planning/run_plan.py`).
"""

from titanlite.config.help import USAGE, describe_type, field_docs, first_sentence, help_requested, help_text
from titanlite.config.loading import apply_dict, load_config, load_toml, parse_overrides, validate
from titanlite.config.ranges import FRACTION, NON_NEGATIVE, POSITIVE, Range
from titanlite.config.schema import (
    CHOICES,
    DEFAULT_CONFIG,
    SPLIT_BACKWARD_SCHEDULES,
    ActivationCheckpoint,
    Checkpoint,
    Comm,
    Compile,
    DatasetSource,
    DtypeName,
    Float8,
    GpuName,
    Job,
    JobConfig,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Profiling,
    Training,
    Validation,
)
from titanlite.errors import ConfigError

__all__ = [
    "CHOICES",
    "DEFAULT_CONFIG",
    "FRACTION",
    "NON_NEGATIVE",
    "POSITIVE",
    "SPLIT_BACKWARD_SCHEDULES",
    "USAGE",
    "ActivationCheckpoint",
    "Checkpoint",
    "Comm",
    "Compile",
    "DatasetSource",
    "Float8",
    "ConfigError",
    "DtypeName",
    "GpuName",
    "Job",
    "JobConfig",
    "LRScheduler",
    "Metrics",
    "Model",
    "Optimizer",
    "Parallelism",
    "Profiling",
    "Range",
    "Training",
    "Validation",
    "apply_dict",
    "describe_type",
    "field_docs",
    "first_sentence",
    "help_requested",
    "help_text",
    "load_config",
    "load_toml",
    "parse_overrides",
    "validate",
]
