"""A second model family, registered from outside titanlite, trained by the unchanged trainer.

`tests/workers/mlp_lm.py [trainer arguments] --model.name mlp_lm --model.flavor tiny` (on 2 ranks,
`harness.launch_workers`) registers a two-block MLP language model (embedding -> [norm, MLP, residual] x 2
-> norm -> output) as a `ModelSpec` of data only (its model, flavor and block container: no parallelism
code), then runs `titanlite.train.main`: config, build (AC, compile, SimpleFSDP or FSDP2 in the framework's
order), step, metrics and checkpoints know nothing of the model.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
from torch import nn

from titanlite.errors import run_cli
from titanlite.models.common.init import InitSpec, init_parameter_
from titanlite.models.registry import ModelSpec, register_model
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


SPEC = ModelSpec(name="mlp_lm", model_cls=MLPLM, flavors={"tiny": MLPArgs()}, units=units)
"""No tensor-parallel styles: AC, compile and SimpleFSDP/FSDP2 come from the framework's parallelize."""

if __name__ == "__main__":
    from titanlite.train import main

    register_model(SPEC)
    sys.exit(run_cli(main))
