"""The `optimizer`, `lr_scheduler` and `validation` sections of the config, beside the code a rank runs with them
(`optimizer.py`, `validation.py`). Torch-free, importing only `titanlite.config.ranges`: the config's schema
(titanlite/config/schema.py) composes them into `JobConfig`, which the launcher and `--help` read before any
torch process exists."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from titanlite.config.ranges import FRACTION, NON_NEGATIVE, POSITIVE, _range


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
