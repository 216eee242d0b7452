"""How a model divides into repeated blocks and the root modules around them.

Every parallelism here works per unit: FSDP gathers and frees a block's weights together, activation
checkpointing and compilation wrap each block, bucketing puts one block in one bucket. A model
family names its block container once (`ModelSpec.units`, e.g. `Units.of(model, "layers")`); the generic
code never spells a model's module names.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Units:
    blocks: dict[str, nn.Module]
    """FQN -> transformer block, in forward order (e.g. `layers.0` ... `layers.N-1`)."""
    before: tuple[str, ...]
    """FQNs of the root modules that run before the blocks (the embedding)."""
    after: tuple[str, ...]
    """FQNs of the root modules that run after the blocks (final norm, output projection)."""

    @classmethod
    def of(cls, model: nn.Module, container: str) -> Units:
        """Split `model`'s children around the `nn.ModuleDict` (or `ModuleList`) named `container`."""
        names = [n for n, _ in model.named_children()]
        split = names.index(container)
        blocks = {f"{container}.{k}": b for k, b in getattr(model, container).named_children()}
        return cls(blocks, tuple(names[:split]), tuple(names[split + 1 :]))

    @property
    def roots(self) -> tuple[str, ...]:
        return self.before + self.after

    def unit_of(self, fqn: str) -> str:
        """The block FQN a parameter FQN lies in, or `""` for a root parameter."""
        for block in self.blocks:
            if fqn == block or fqn.startswith(block + "."):
                return block
        return ""
