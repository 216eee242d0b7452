"""Which settings may change when a run resumes from a checkpoint, decided before anything loads.

A checkpoint's completion marker records the layout that wrote it and what the run trained with (`RunRecord`:
the config, the dataset and tokenizer fingerprints of `fingerprint.py`, the effective global batch and
virtual shards). `compare_settings` holds a resuming run against it in three classes: what cannot change (the
model and its shape keys, the tokenizer, `training.seq_len`, the global batch, the virtual shards and the
dataset, unless `training.allow_dataset_change`), stopping with one line naming the key and both values (exit
2); what is resharded (`parallelism.*`, `training.local_batch_size`); and everything else, which takes the new
value (optimizer, LR schedule, `training.steps`, checkpoint, metrics, compile and AC keys). The full table:
docs/checkpoints.md#resuming.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from titanlite.checkpoint.fingerprint import (
    dataset_fingerprint,
    describe_dataset,
    describe_mixture_change,
    edge_fingerprint,
    mixture_fingerprint,
    tokenizer_fingerprint,
)
from titanlite.data.mixture import MixedSources
from titanlite.models.registry import ModelSpec, get_model_spec
from titanlite.planning.run_plan import RunPlan

# Config keys that name where or how this launch runs rather than what it trains: not reported as changes.
_NOT_SETTINGS = {"job.dump_folder", "job.config_file", "job.print_config", "checkpoint.load_step"}
# Keys that choose a fresh run's first weights: a resume reads its own checkpoint instead, so a change to
# them is reported as not applied (never as a new value that applies).
_FIRST_WEIGHTS = {"checkpoint.initial_load_path", "checkpoint.initial_load_in_hf"}


@dataclass
class ResumeCheck:
    """What comparing a checkpoint's recorded settings with this run's found."""

    changed: list[str]
    """`key old -> new` for every changed setting, logged in one line."""
    error: str | None = None
    """A setting that cannot change did: the one line the resume stops with."""
    dataset_changed: str | None = None
    """The dataset changed and `training.allow_dataset_change` accepts it: the warning to log."""
    not_applied: list[str] = field(default_factory=list)
    """`key old -> new` for each changed `_FIRST_WEIGHTS` key, which a resume does not read: a warning line."""


def _flat(config: dict) -> dict:
    """`section.key` -> value of a config as `JobConfig.to_dict()` gives it."""
    return {f"{section}.{key}": value for section, body in config.items() for key, value in body.items()}


def model_shape(flat: dict, spec: ModelSpec) -> list:
    """The effective value of each of the family's shape keys (`spec.shape.keys`) for a flat config: the
    override, else the flavor's (so a resume names the real shape, e.g. 6 layers, never the 0 that means
    "the flavor's"). Overrides are absent from older checkpoints; an unknown flavor leaves the raw values."""
    raw = [flat.get(f"model.{k}", 0) for k in spec.shape.keys]
    args = spec.flavors.get(flat.get("model.flavor", ""))
    if args is None:
        return raw
    args = dataclasses.replace(args, **{k: v for k, v in zip(spec.shape.keys, raw) if v})
    return list(spec.resolved_shape(args).values())


def model_change(marker: dict, config: dict) -> tuple[str, object, object] | None:
    """`(key, recorded, now)` for the first of the model's settings that differs between what checkpoint
    `marker` recorded and `config` (`JobConfig.to_dict()`): `model.name`, `model.flavor`, then the family's
    shape keys as built (`model_shape`); None when none differs or the marker records no config."""
    if "config" not in marker:
        return None
    old, new = _flat(marker["config"]), _flat(config)
    pairs = [(k, old.get(k), new[k]) for k in ("model.name", "model.flavor")]
    if old.get("model.name") == new["model.name"]:
        spec = get_model_spec(new["model.name"])
        shape = zip(spec.shape.keys, model_shape(old, spec), model_shape(new, spec))
        pairs += [(f"model.{k}", was, now) for k, was, now in shape]
    return next(((k, was, now) for k, was, now in pairs if was != now), None)


def compare_settings(
    path: str, marker: dict, inputs: dict, allow_dataset_change: bool, legacy_dataset: Callable[[], dict] | None = None
) -> ResumeCheck:
    """This run's `inputs` (as `RunRecord.inputs` records them) against checkpoint `path`'s
    `marker` (module docstring). `legacy_dataset` computes this run's dataset fingerprint the way a
    checkpoint without a fingerprint `method` recorded it (`fingerprint.edge_fingerprint`)."""
    if "config" not in marker:
        return ResumeCheck([])  # written before checkpoints recorded their settings
    old, new = _flat(marker["config"]), _flat(inputs["config"])
    model = model_change(marker, inputs["config"])
    fixed = [
        *([(*model, "")] if model else []),  # the model's name, flavor and shape as built
        ("training.seq_len", old.get("training.seq_len"), new["training.seq_len"], ""),
        ("training.global_batch_size", marker["global_batch"], inputs["global_batch"], " samples per step"),
        ("training.dataset_virtual_shards", marker["virtual_shards"], inputs["virtual_shards"], " virtual shards"),
    ]
    was_tok, now_tok = marker.get("tokenizer"), inputs["tokenizer"]
    if was_tok and now_tok and was_tok["digest"] != now_tok["digest"]:
        fixed.append(
            (
                "model.tokenizer_path",
                f"{was_tok['name']} (digest {was_tok['digest']})",
                f"{now_tok['name']} (digest {now_tok['digest']})",
                "",
            )
        )
    for key, was, now, unit in fixed:
        if was != now:
            return ResumeCheck(
                [],
                f"checkpoint {path}: {key} was {was}{unit}, this run has {now}{unit}; it cannot change when "
                "resuming (restore it, or train in another job.dump_folder)",
            )
    changes = {
        key: f"{key} {json.dumps(old[key])} -> {json.dumps(value)}"
        for key, value in new.items()
        if key in old and old[key] != value and key not in _NOT_SETTINGS
    }
    changed = [line for key, line in changes.items() if key not in _FIRST_WEIGHTS]
    not_applied = [line for key, line in changes.items() if key in _FIRST_WEIGHTS]
    was, now = marker.get("dataset"), inputs["dataset"]
    if was and now and was.get("method") != now.get("method") and legacy_dataset is not None:
        now = legacy_dataset()
    if not (was and now and was["digest"] != now["digest"]):
        return ResumeCheck(changed, not_applied=not_applied)
    what = f"training.dataset_path was {describe_dataset(was)}, this run reads {describe_dataset(now)}"
    if "sources" in was or "sources" in now:
        what = describe_mixture_change(was, now)
    if was["text_field"] != now["text_field"]:
        what = f"training.dataset_text_field was {was['text_field']!r}, this run has {now['text_field']!r}"
    if not allow_dataset_change:
        return ResumeCheck(
            changed,
            f"checkpoint {path}: {what}; its data positions would point into other documents (set "
            "training.allow_dataset_change = true to read the new dataset from its beginning)",
            not_applied=not_applied,
        )
    return ResumeCheck(
        changed,
        not_applied=not_applied,
        dataset_changed=f"checkpoint {path}: {what}; training.allow_dataset_change = true: the data stream "
        "restarts from the beginning of the new dataset (model and optimizer state are resumed)",
    )


class RunRecord:
    """What a completion marker records of the run that wrote it (module docstring), and the check of a
    resuming run against a marker. The fingerprints of the inputs are taken once per run, on rank 0 (it
    writes the markers and compares on resume)."""

    def __init__(self, plan: RunPlan, dataloader, rank: int) -> None:
        self.plan = plan
        cfg = plan.cfg
        self._dataset = self._tokenizer = None
        if rank == 0 and dataloader is not None:
            source, t = dataloader.dataset.source, cfg.training
            if isinstance(source, MixedSources):
                self._dataset = mixture_fingerprint(source, t.dataset_text_field, t.seed)
            else:
                self._dataset = dataset_fingerprint(
                    source, t.dataset_text_field, holdout_documents=cfg.validation.holdout_documents
                )
            self._tokenizer = tokenizer_fingerprint(cfg.model.tokenizer_path)

    def layout(self) -> dict:
        """The parallel layout that wrote a checkpoint: a resume on another one reshards."""
        cfg = self.plan.cfg
        return {
            **self.plan.dims.world_layout.to_marker(),
            "dp_impl": cfg.parallelism.dp_impl,
            "flavor": cfg.model.flavor,
        }

    def inputs(self) -> dict:
        """What a resume compares with (module docstring)."""
        return {
            "config": self.plan.cfg.to_dict(),
            "global_batch": self.plan.global_batch,
            "virtual_shards": self.plan.virtual_shards,
            "dataset": self._dataset,
            "tokenizer": self._tokenizer,
        }

    def compare(self, path: str, marker: dict) -> ResumeCheck:
        """This run's settings against the ones `marker` recorded (rank 0)."""
        t = self.plan.cfg.training
        holdout = self.plan.cfg.validation.holdout_documents
        return compare_settings(
            path,
            marker,
            self.inputs(),
            t.allow_dataset_change,
            lambda: edge_fingerprint(t.dataset_path, t.dataset_text_field, holdout_documents=holdout),
        )
