"""The domains of config keys, for every section module to declare its keys with: the numeric domain
(`Range`), kept on its field so validation reads it there, and the dtype names a key may take.
Imports nothing but the standard library: section modules beside their code import it alone."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class Range:
    """The domain of a numeric config key, kept on its field (`metadata=`) so `validate` checks every key
    from the schema itself: a new key declares its range where it is declared, and cannot be forgotten.

    `also` is one extra allowed value outside the interval (a sentinel such as -1 = "the rest").
    """

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    also: float | None = None
    also_means: str = ""

    def __contains__(self, value: float) -> bool:
        if value == self.also:
            return True
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def describe(self) -> str:
        """The domain in words: `positive`, `non-negative`, `in [0, 1)`, `>= 2`, with the sentinel first."""
        if self.high == math.inf and self.low == 0:
            text = "positive" if self.low_open else "non-negative"
        elif self.low == 0 and self.low_open:
            text = f"positive and {'<' if self.high_open else '<='} {_num(self.high)}"
        elif self.high == math.inf:
            text = f"{'>' if self.low_open else '>='} {_num(self.low)}"
        elif self.low == -math.inf:
            text = f"{'<' if self.high_open else '<='} {_num(self.high)}"
        else:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            text = f"in {left}{_num(self.low)}, {_num(self.high)}{right}"
        if self.also is None:
            return text
        means = f" ({self.also_means})" if self.also_means else ""
        return f"{_num(self.also)}{means} or {text}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _range(**kwargs: Any) -> dict[str, Range]:
    """Field metadata holding a `Range`."""
    return {"range": Range(**kwargs)}


POSITIVE = _range(low=0, low_open=True)
NON_NEGATIVE = _range(low=0)
FRACTION = _range(low=0, high=1)  # [0, 1]
TIMEOUT = _range(low=0, low_open=True, high=7 * 24 * 3600)
"""Seconds a collective may wait: at most a week (torch's backends keep milliseconds; far beyond any real
wait, and a typo's huge number fails the key, not a rank's process group)."""

DtypeName = Literal["float32", "bfloat16", "float16"]
"""The dtypes a config can name; `torch_support.dtype` maps them to torch's."""
