"""Fixtures shared by the tests; launchers, tolerances and the tiny model are in harness.py."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from harness import one_rank_group, threads


@pytest.fixture
def process_group():
    """A one-rank gloo process group for the test (as a single-process run has one)."""
    with one_rank_group():
        yield


def pytest_configure(config: pytest.Config) -> None:
    """The in-process tests' intra-op threads: the cores are shared with the other test process (an idle
    OpenMP thread spins a while before it sleeps, on a core the other process could use).

    A suite started in the background by a shell without job control (`cmd &` in a script) inherits
    SIGINT ignored, and so would every launch under test, which then never sees the Ctrl-C that the
    launcher tests send. A caught SIGINT is reset to the default in each child at exec.

    Inductor on a CPU first dry-compiles a test program for each vector ISA the CPU reports, into its
    compile cache folder; the tests give each compiling test a fresh folder (its ranks share it), so
    every process that compiled paid it again (about 8 of a 16-second first compile here). `TORCHINDUCTOR_VEC_ISA_OK=1`
    (torch's own switch, read when inductor's config is first imported, which no test has done yet)
    takes the ISAs the CPU reports as they are: the same ISA is chosen (avx512 on this machine's CPU),
    and a compiler that lacked it would fail the compile instead of falling back. Every launch inherits
    it (harness.child_env copies this environment)."""
    torch.set_num_threads(threads())
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
