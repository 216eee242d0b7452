"""Fixtures shared by the tests; launchers, tolerances and the tiny model are in harness.py."""

from __future__ import annotations

import pytest

from harness import one_rank_group


@pytest.fixture
def process_group():
    """A one-rank gloo process group for the test (as a single-process run has one)."""
    with one_rank_group():
        yield
