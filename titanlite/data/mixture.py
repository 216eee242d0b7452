"""Weighted mixtures of sources (`training.datasets`): which source each sample of a virtual shard comes from.

Each source is an ordinary source (`sources.py`) cut into the same V virtual shards as a single dataset
(`dataset.py`): virtual shard v of the mixture holds one packed stream per source, each over that source's
documents `v, v + V, ...`. A sample (one window of `seq_len + 1` tokens) is cut from one source's stream, so
the tokens of a step are split between the sources exactly as its samples are.

Which source sample n of shard v comes from is a function of (seed, v, n) alone, so the mixture is the
same for every layout, worker count and resume point, and the samples each source gave a shard after n
of them have a closed form (`Mixture.counts`). The rule is a chain of even splits: the first source takes
`floor(n * p + u_v)` of shard v's first n samples (p its weight over the sum of the weights), the second
takes the same share of the rest with its weight over the remaining weights, and so on; the last source
takes what is left. The phases are spread evenly over the shards from one drawn from the seed per split,
`u_v = frac(u + v / V)`: each shard follows the weights within a sample per split at every step, and
(Hermite's identity, every shard having given the same number of samples at a step boundary) the first
source's share of all the samples so far is within one sample of its weight, the others' within a few
samples of theirs (what reaches a later split differs by a sample between shards). Shares
and phases are fixed-point integers (32 fractional bits): the order is the same on every machine.

A source that runs out starts over (its epoch), alone: the weights hold for the whole run, however long
or short each source is, and `data: <name>: epoch E begins at step N` says when.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from titanlite.data.sources import DocumentSource

FRACTION_BITS = 32
"""Fixed-point precision of the shares and phases."""


class Mixture:
    """The interleaving of named sources by weight, from a seed (module docstring)."""

    def __init__(self, names: list[str], weights: list[float], seed: int, num_shards: int) -> None:
        if not names or len(names) != len(weights) or min(weights) <= 0 or num_shards < 1:
            raise ValueError(f"a mixture needs positive weights for its sources: {names} {weights}")
        self.names, self.weights, self.seed, self.num_shards = list(names), list(weights), seed, num_shards
        one = 1 << FRACTION_BITS
        # The share of what reaches split s that source s takes (the last source takes the rest).
        self._splits = [round(w / sum(weights[s:]) * one) for s, w in enumerate(weights[:-1])]
        self._drawn = [  # u of each split, from the seed
            int.from_bytes(hashlib.blake2b(f"{seed}/{s}".encode(), digest_size=8).digest(), "little")
            >> (64 - FRACTION_BITS)
            for s in range(len(self._splits))
        ]

    def _phase(self, shard: int) -> list[int]:
        """Each split's phase in `shard`: frac(u + shard / V), in fixed point."""
        step = (shard << FRACTION_BITS) // self.num_shards
        return [(u + step) % (1 << FRACTION_BITS) for u in self._drawn]

    def counts(self, shard: int, n: int) -> list[int]:
        """How many of virtual shard `shard`'s first `n` samples each source gave."""
        out, rest = [], n
        for share, phase in zip(self._splits, self._phase(shard)):
            taken = (rest * share + phase) >> FRACTION_BITS
            out.append(taken)
            rest -= taken
        out.append(rest)
        return out

    def source_of(self, shard: int, n: int) -> int:
        """The source of sample `n` (from 0) of virtual shard `shard`: the one whose count it raises."""
        before, after = self.counts(shard, n), self.counts(shard, n + 1)
        return next(s for s, (a, b) in enumerate(zip(before, after)) if b > a)

    def samples(self, n: int) -> dict[str, int]:
        """Samples each source gave all the shards once each has produced `n`: a step boundary's totals
        (every shard gives the same number of samples to a step)."""
        totals = [0] * len(self.names)
        for shard in range(self.num_shards):
            for s, c in enumerate(self.counts(shard, n)):
                totals[s] += c
        return dict(zip(self.names, totals))


@dataclass
class MixedSources:
    """The sources of a mixture, opened, in the mixture's order, with their interleaving."""

    sources: list[DocumentSource]
    mixture: Mixture

    @property
    def name(self) -> str:
        """The mixture for log lines: `web 0.8 + code 0.2`."""
        return " + ".join(f"{n} {w:g}" for n, w in zip(self.mixture.names, self.mixture.weights))
