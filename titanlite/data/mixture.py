"""Weighted mixtures of sources (`training.datasets`): which source each sample of a virtual shard comes from.

Each source is cut into the same V virtual shards as a single dataset (`dataset.py`): shard v of the
mixture holds one packed stream per source, and each sample is cut from one of them. Which source sample
n of shard v comes from is a function of (seed, v, n) alone, so the mixture is the same for every
layout, worker count and resume point, and the samples each source gave a shard have a closed form
(`Mixture.counts`). The rule is a balanced binary tree of even splits with per-shard phases, so each
shard is within `ceil(log2 K)` samples of the weights and all shards together within a few; shares and
phases are fixed-point integers, the same on every machine. A source that runs out starts over alone.
The rule, its bounds and their measurement: docs/configuration.md#mixtures.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from titanlite.data.sources import DocumentSource

FRACTION_BITS = 32
"""Fixed-point precision of the shares and phases."""


GOLDEN = 0x9E3779B9
"""2^32 / golden ratio: the fixed-point step between deeper nodes' lattice multipliers."""


def _coprime_near(target: int, modulus: int) -> int:
    """The multiplier in 1..modulus nearest `target` (ties upward) that is coprime to `modulus`, so that
    `a * v mod V` is a permutation of the shards."""
    for distance in range(modulus + 1):
        for a in (target + distance, target - distance):
            if math.gcd(a % modulus, modulus) == 1:
                return a % modulus
    return 1


@dataclass(frozen=True)
class _Node:
    """One split of the tree: sources [lo, mid) go left, [mid, hi) right."""

    lo: int
    mid: int
    hi: int
    share: int  # q in fixed point
    phases: tuple[int, ...]  # per shard, in fixed point


class Mixture:
    """The interleaving of named sources by weight, from a seed (module docstring)."""

    def __init__(self, names: list[str], weights: list[float], seed: int, num_shards: int) -> None:
        if not names or len(names) != len(weights) or min(weights) <= 0 or num_shards < 1:
            raise ValueError(f"a mixture needs positive weights for its sources: {names} {weights}")
        self.names, self.weights, self.seed, self.num_shards = list(names), list(weights), seed, num_shards
        self._nodes: list[_Node] = []
        self._build(0, len(weights), depth=0)

    def _build(self, lo: int, hi: int, depth: int) -> None:
        """Append the nodes of the subtree over sources [lo, hi), in preorder."""
        if hi - lo < 2:
            return
        one, shards = 1 << FRACTION_BITS, self.num_shards
        mid = (lo + hi + 1) // 2
        share = round(sum(self.weights[lo:mid]) / sum(self.weights[lo:hi]) * one)
        index = len(self._nodes)
        if depth == 0:
            a = 1
        elif depth == 1:
            a = _coprime_near((share * shards + one // 2) >> FRACTION_BITS, shards)
        else:
            a = _coprime_near((((index * GOLDEN) % one) * shards) >> FRACTION_BITS, shards)
        u = int.from_bytes(hashlib.blake2b(f"{self.seed}/{index}".encode(), digest_size=8).digest(), "little")
        u >>= 64 - FRACTION_BITS
        phases = tuple((u + ((v * a % shards) << FRACTION_BITS) // shards) % one for v in range(shards))
        self._nodes.append(_Node(lo, mid, hi, share, phases))
        self._build(lo, mid, depth + 1)
        self._build(mid, hi, depth + 1)

    def counts(self, shard: int, n: int) -> list[int]:
        """How many of virtual shard `shard`'s first `n` samples each source gave."""
        reach = {(0, len(self.names)): n}
        for node in self._nodes:  # preorder: a node's count is known before its children's
            m = reach.pop((node.lo, node.hi))
            left = (m * node.share + node.phases[shard]) >> FRACTION_BITS
            reach[(node.lo, node.mid)], reach[(node.mid, node.hi)] = left, m - left
        return [reach[(s, s + 1)] for s in range(len(self.names))]

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
