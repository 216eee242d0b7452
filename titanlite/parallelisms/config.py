"""The `parallelism` and `activation_checkpoint` sections of the config. `Parallelism` is the union of the
keys each parallelism declares beside its code (`<unit>/config.py`), so a unit's keys live with the unit
and the TOML section stays one; its keys follow the units' order (data, tensor, context, expert, pipeline).
Torch-free, importing only the units' config modules: the config's schema (titanlite/config/schema.py)
composes them into `JobConfig`, which the launcher and `--help` read before any
torch process exists."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from titanlite.parallelisms.context_parallel.config import ContextParallel
from titanlite.parallelisms.data_parallel.config import DataParallel
from titanlite.parallelisms.expert_parallel.config import ExpertParallel
from titanlite.parallelisms.pipeline.config import Pipeline
from titanlite.parallelisms.tensor_parallel.config import TensorParallel


@dataclass
class Parallelism(Pipeline, ExpertParallel, ContextParallel, TensorParallel, DataParallel):
    """How the world of ranks is split: data parallel (FSDP, HSDP), context, tensor and pipeline parallel."""


@dataclass
class ActivationCheckpoint:
    """Recomputing activations in backward to save memory."""

    mode: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward: `none`, `full` (every block) or `selective`."""
    selective_ac_option: str = "op"
    """`op` (save attention and every other matmul output, recompute the rest: TorchTitan's rule),
    `op_all_mm` (save every matmul output) or an integer k (every k-th block fully); see
    titanlite/parallelisms/activation_checkpoint.py."""
