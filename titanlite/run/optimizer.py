"""AdamW and learning-rate schedules; gradient clipping, correct for DTensor gradients, is the step's
(`parallelisms/clipping.py`, re-exported here)."""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn

from titanlite.config import LRScheduler, Optimizer
from titanlite.parallelisms.clipping import clip_grad_norm_

__all__ = ["build_lr_scheduler", "build_optimizer", "clip_grad_norm_", "lr_factor"]


def build_optimizer(model: nn.Module, cfg: Optimizer) -> torch.optim.Optimizer:
    if cfg.name != "AdamW":
        raise ValueError(f"optimizer.name {cfg.name!r}: only AdamW is provided")
    impl = {"foreach": dict(foreach=True), "fused": dict(fused=True), "for-loop": dict(foreach=False)}[
        cfg.implementation
    ]
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        **impl,
    )


def lr_factor(
    step: int, *, total_steps: int, warmup_steps: int, decay_ratio: float, decay_type: str, min_lr_factor: float
) -> float:
    """Multiplier of the base LR after `step` completed optimizer steps (0-based): warmup, stable, decay.

    Warmup is linear from 1/(warmup+1) to 1; the last `decay_ratio` of the post-warmup steps decay to
    `min_lr_factor` (decay_ratio < 1 is warmup-stable-decay, WSD).
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    decay_steps = max(1, round((total_steps - warmup_steps) * decay_ratio))
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / decay_steps)
    curve = {
        "linear": 1.0 - progress,
        "cosine": 0.5 * (1.0 + math.cos(math.pi * progress)),
        "sqrt": 1.0 - math.sqrt(progress),
    }[decay_type]
    return min_lr_factor + (1.0 - min_lr_factor) * curve


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRScheduler, total_steps: int):
    fn = partial(
        lr_factor,
        total_steps=total_steps,
        warmup_steps=cfg.warmup_steps,
        decay_ratio=cfg.decay_ratio,
        decay_type=cfg.decay_type,
        min_lr_factor=cfg.min_lr_factor,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
