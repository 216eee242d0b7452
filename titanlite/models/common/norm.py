"""RMSNorm as Llama 3 and Qwen3 use it: normalised in fp32 whatever the activation dtype, then cast back,
so bf16 training normalises as precisely as fp32 (the weight is the parameter `weight`, TorchTitan's name)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).type_as(x)
