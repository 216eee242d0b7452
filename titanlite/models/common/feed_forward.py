"""The SwiGLU feed-forward of Llama 3 and of Qwen3-MoE's dense layers: `w2(silu(w1 x) * w3 x)`. The
parameter names `w1`, `w2`, `w3` are TorchTitan's, which the tensor-parallel styles and the Hugging Face
converters address by name."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
