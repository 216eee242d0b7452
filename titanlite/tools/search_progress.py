"""Progress of a long layout search: one line on stderr every `PROGRESS_SECONDS`, naming how far the
search is through the world's meshes (`layout_space.factorisations`, in the order the search takes
them), the layouts estimated and those that fit so far. A search of a few hundred GPUs ends within
seconds and prints none; one of 100,000 runs for minutes, and without these lines it would look hung.
The lines go to stderr, so the ranked table on stdout stays what a script reads."""

from __future__ import annotations

import sys
import time

from titanlite.planning.layout_space import Degrees, factorisations

PROGRESS_SECONDS = 30.0
"""Seconds between progress lines (the first comes after as long)."""


def clock() -> float:
    """The progress clock (a module function so that a test can move time on)."""
    return time.monotonic()


class SearchProgress:
    """`update` after each estimate; it prints when `PROGRESS_SECONDS` have passed since the last line."""

    def __init__(self, world: int):
        self.mesh_index = {d: i for i, d in enumerate(factorisations(world))}
        self.started = clock()
        self.due = self.started + PROGRESS_SECONDS

    def update(self, degrees: Degrees, tried: int, fit: int) -> None:
        now = clock()
        if now < self.due:
            return
        self.due = now + PROGRESS_SECONDS
        mesh = f"mesh {self.mesh_index[degrees] + 1:,} of {len(self.mesh_index):,} ({degrees.describe()})"
        print(
            f"layout search: {mesh} after {now - self.started:.0f} s; layouts so far: {tried:,} estimated, {fit:,} fit",
            file=sys.stderr,
            flush=True,
        )
