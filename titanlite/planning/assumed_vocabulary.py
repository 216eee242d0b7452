"""The run plan of a config for planning, where the tokenizer file may be absent.

Planning needs only the tokenizer's vocabulary size, so a dry run or a layout search of a config whose
tokenizer has not been built yet plans with `model.vocab_size`, else the flavor's published vocabulary,
and says so in a note. Everything else is checked exactly as a launch checks it (`RunPlan.build`).
"""

from __future__ import annotations

from pathlib import Path

from titanlite.config import JobConfig
from titanlite.data.tokenizer import build_tokenizer
from titanlite.models.registry import get_model_spec
from titanlite.planning.run_plan import RunPlan, model_args


def build_run_plan(cfg: JobConfig, world_size: int) -> tuple[RunPlan, list[str]]:
    """RunPlan.build, except that a missing tokenizer file only costs the exact vocabulary size; the notes
    name the vocabulary assumed."""
    path = cfg.model.tokenizer_path
    if not path or Path(path).exists():
        return RunPlan.build(cfg, world_size), []
    spec = get_model_spec(cfg.model.name)
    if cfg.model.vocab_size:
        vocab, source = cfg.model.vocab_size, "model.vocab_size"
    else:
        vocab = spec.flavors[cfg.model.flavor].vocab_size if cfg.model.flavor in spec.flavors else 0
        source = f"the {cfg.model.flavor} flavor's vocabulary"
    plan = RunPlan.build(cfg, world_size, tokenizer=build_tokenizer(None), args=model_args(cfg, spec, vocab))
    return plan, [f"tokenizer {path} not found: planned with {source} of {vocab:,}"]
