"""What a resume says about the settings that changed since its checkpoint (`resume_policy.compare_settings`)."""

from __future__ import annotations

from titanlite.checkpoint.resume_policy import compare_settings
from titanlite.config import load_config

CONFIG = "train_configs/debug_model.toml"


def check(old: list[str], new: list[str]):
    marker = {"config": load_config(old, default_config=CONFIG).to_dict(), "global_batch": 16, "virtual_shards": 8}
    config = load_config(new, default_config=CONFIG).to_dict()
    inputs = {"config": config, "global_batch": 16, "virtual_shards": 8, "tokenizer": None, "dataset": None}
    return compare_settings("step-2", marker, inputs, allow_dataset_change=False)


def test_changed_initial_weights_are_reported_as_not_read():
    """A resume reads its own checkpoint: a new `initial_load_path` (or `initial_load_in_hf`) is not among the
    settings whose new values apply, but said apart; a changed setting that applies is not (the control)."""
    first = ["--checkpoint.initial_load_path", "/a", "--checkpoint.initial_load_in_hf"]
    result = check(first, ["--checkpoint.initial_load_path", "/b", "--training.steps", "7"])
    assert result.error is None
    assert result.changed == ["training.steps 100 -> 7"]
    assert result.not_applied == [
        'checkpoint.initial_load_path "/a" -> "/b"',
        "checkpoint.initial_load_in_hf true -> false",
    ]
    assert check(first, first).not_applied == []
