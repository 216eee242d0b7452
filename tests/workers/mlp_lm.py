"""A second model family, registered from outside titanlite, trained by the unchanged trainer.

`torchrun ... tests/workers/mlp_lm.py [trainer arguments] --model.name mlp_lm --model.flavor tiny`
registers a two-block MLP language model (embedding -> [norm, MLP, residual] x 2 -> norm -> output)
with its own parallelize plan, built only from titanlite's model-agnostic pieces, then runs
`titanlite.train.main`: config, build, step, metrics and checkpoints know nothing of the model.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
from torch import nn

from titanlite.config import JobConfig
from titanlite.dtypes import DTYPES
from titanlite.errors import run_cli
from titanlite.models.init import InitSpec, init_parameter_
from titanlite.models.registry import ModelSpec, register_model
from titanlite.parallelisms.activation_checkpoint import apply_ac
from titanlite.parallelisms.parallel_dims import ParallelDims
from titanlite.parallelisms.reshard import ReshardPlan
from titanlite.parallelisms.simple_fsdp import MixedPrecisionPolicy, apply_reshard, data_parallel
from titanlite.parallelisms.units import Units


@dataclasses.dataclass
class MLPArgs:
    dim: int = 64
    n_layers: int = 2
    vocab_size: int = 0
    max_seq_len: int = 4096

    def num_params(self) -> int:
        return 2 * self.vocab_size * self.dim + self.n_layers * (8 * self.dim * self.dim + 2 * self.dim) + self.dim

    def flops_per_token(self, seq_len: int) -> float:
        return 6 * self.num_params()


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class MLPLM(nn.Module):
    def __init__(self, args: MLPArgs, seq_len: int | None = None):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(args.dim) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h)
        return self.output(self.norm(h))

    def init_weights(self, seed: int, buffer_device: torch.device | None = None) -> None:
        for fqn, param in self.named_parameters():
            spec = InitSpec("ones") if "norm" in fqn else InitSpec("trunc_normal", std=0.02)
            init_parameter_(param, spec, seed, fqn)


def units(model: nn.Module) -> Units:
    return Units.of(model, "layers")


def parallelize(model: nn.Module, dims: ParallelDims, cfg: JobConfig) -> nn.Module:
    """Data parallelism and AC only (no TP plan: this family declares none)."""
    u = units(model)
    apply_ac(u.blocks, cfg.activation_checkpoint)
    if dims.dp_enabled:
        mp = MixedPrecisionPolicy(
            DTYPES[cfg.training.mixed_precision_param], DTYPES[cfg.training.mixed_precision_reduce]
        )
        data_parallel(model, dims.submesh(dims.dim_names), dims.dp_mode, mp, dp_ndim=len(dims.dp_dim_names))
        apply_reshard(
            model,
            u,
            ReshardPlan.of(
                cfg.parallelism.fsdp_reshard_after_forward, len(u.blocks), gathers=dims.dp_mode != "replicate"
            ),
        )
    return model


register_model(
    ModelSpec(name="mlp_lm", model_cls=MLPLM, flavors={"tiny": MLPArgs()}, parallelize=parallelize, units=units)
)

if __name__ == "__main__":
    from titanlite.train import main

    sys.exit(run_cli(main))
