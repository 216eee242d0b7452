"""What every family's Hugging Face adapter reads of a `config.json` the same way: RoPE's theta and scaling
across transformers 4 and 5, the dtype names, and when a checkpoint's value differs from the model's."""

from __future__ import annotations

import math
from typing import Any

import torch

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_rope(config: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling or None) of an HF config: `rope_theta` + `rope_scaling` (transformers 4) or
    `rope_parameters` (transformers 5); HF's default theta is 10000."""
    params = dict(config.get("rope_parameters") or {})
    theta = config.get("rope_theta", params.pop("rope_theta", 10000.0))
    params.pop("rope_theta", None)
    scaling = config.get("rope_scaling") or params or None
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return float(theta), scaling


def differ(a: Any, b: Any) -> bool:
    """Whether a checkpoint's value and the model's disagree (numbers to a relative 1e-9)."""
    if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
        return not math.isclose(a, b, rel_tol=1e-9)
    return a != b
