"""Tensor parallelism's keys of the `parallelism` section. Torch-free, importing only `titanlite.config.ranges`:
`titanlite/parallelisms/config.py` composes it into the `parallelism` section."""

from __future__ import annotations

from dataclasses import dataclass, field

from titanlite.config.ranges import POSITIVE


@dataclass
class TensorParallel:
    """Tensor parallel: each layer's matmuls split over ranks."""

    tensor_parallel_degree: int = field(default=1, metadata=POSITIVE)
    """Ranks splitting each layer's matmuls (Megatron-style tensor parallelism)."""
    disable_loss_parallel: bool = False
    """Gather the vocabulary-sharded logits before the loss instead of a sharded cross-entropy (TP only)."""
