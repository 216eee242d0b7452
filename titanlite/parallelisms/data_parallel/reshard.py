"""Reshard-after-forward: which gathered weights are freed after forward and gathered again in backward.

One policy (`parallelism.fsdp_reshard_after_forward`) for every implementation:

    default   every block but the last (the last block's backward starts right after forward, so
              freeing its weights would only buy an immediate re-gather); the root modules keep theirs
    always    every block and every root module
    never     nothing: gathered weights live from forward to backward (more memory, fewer gathers)
    auto      as default here; with several backwards per step the step policy may instead keep every
              gathered weight for the whole step (`step_policy.StepPolicy`, `kept_gathers`)

Pure replication gathers nothing, so nothing is resharded. The plan is read by SimpleFSDP eager
(saved-tensor hooks, `eager_reshard.apply_reshard`), SimpleFSDP compiled (recompute tags,
`passes.ReshardTagPass`), FSDP2 (`reshard_after_forward` of each `fully_shard`), and the memory estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.parallelisms.units import Units


@dataclass(frozen=True)
class ReshardPolicy:
    blocks: tuple[bool, ...]
    """Per block, in forward order: True = its gathered weights are freed after forward."""
    root: bool
    """The root modules (embedding, final norm, output): True = freed after forward."""

    @classmethod
    def of(cls, policy: str, n_blocks: int, gathers: bool = True) -> ReshardPolicy:
        """The plan of `policy`; `gathers=False` (pure replication) frees nothing."""
        if policy == "never" or not gathers:
            return cls((False,) * n_blocks, False)
        always = policy == "always"
        return cls(tuple(always or i < n_blocks - 1 for i in range(n_blocks)), always)

    @property
    def any(self) -> bool:
        return self.root or any(self.blocks)

    def kept(self, units: Units) -> tuple[str, ...]:
        """FQN prefixes of the units whose gathered weights stay alive from forward to backward."""
        blocks = tuple(fqn for fqn, freed in zip(units.blocks, self.blocks) if not freed)
        return blocks + (() if self.root else units.roots)
