"""The one map from the dtype names a config uses (`config.DtypeName`) to torch dtypes: the config itself
imports no torch, so the map lives here, beside it."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Config dtype name -> torch dtype."""
