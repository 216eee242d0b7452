"""The training configuration: the schema (`schema.py`: `JobConfig`, composed of the sections each package
declares beside its code), loading from TOML and the command line with each key checked alone
(`loading.py`), and the help generated from the schema (`help.py`).

Torch-free on purpose: the launcher's shell, `--help` and the set-up scripts read the config before (or
without) a torch process. Rules between keys, and everything derived from the config with the world size
and the model, are the run plan's (`titanlite/planning/run_plan.py`). The names below load on first use:
a section module beside its code imports `titanlite.config.ranges` without this package importing the
schema that composes that section (which would be a cycle).
"""

from __future__ import annotations

from titanlite.config.lazy_exports import lazy_exports

HOME, __all__, __getattr__ = lazy_exports(
    __name__,
    {
        "titanlite.config.help": (
            "USAGE",
            "describe_type",
            "field_docs",
            "first_sentence",
            "help_requested",
            "help_text",
        ),
        "titanlite.config.loading": ("apply_dict", "load_config", "load_toml", "parse_overrides", "validate"),
        "titanlite.config.ranges": ("FRACTION", "NON_NEGATIVE", "POSITIVE", "DtypeName", "Range"),
        "titanlite.config.schema": ("DEFAULT_CONFIG", "CHOICES", "Comm", "Job", "JobConfig", "Training"),
        # The sections declared beside their code, from their own modules.
        "titanlite.checkpoint.config": ("Checkpoint",),
        "titanlite.compile.config": ("Compile",),
        "titanlite.data.config": ("DatasetSource",),
        "titanlite.metrics.config": ("Metrics", "Profiling"),
        "titanlite.models.config": ("Model",),
        "titanlite.parallelisms.config": ("ActivationCheckpoint", "Parallelism"),
        "titanlite.parallelisms.float8.config": ("Float8",),
        "titanlite.parallelisms.pipeline.config": ("SPLIT_BACKWARD_SCHEDULES",),
        "titanlite.planning.config": ("GpuName",),
        "titanlite.run.config": ("LRScheduler", "Optimizer", "Validation"),
        "titanlite.errors": ("ConfigError",),
    },
)
"""`HOME`: each name this package exports -> the module that defines it; `__all__`: those names."""
