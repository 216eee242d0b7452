"""Stop signals: SIGTERM, SIGUSR1 and Ctrl-C ask a run to stop cleanly, never to die half-way.

This module imports nothing heavy on purpose: the launcher and every rank install their recorder as
their first instruction, before the seconds of `import torch`, so a signal that arrives while a process
starts is remembered instead of killing it (or raising `KeyboardInterrupt` inside some import).

The launcher starts its ranks with the stop signals blocked (`blocked()`): the ranks inherit the mask,
so a signal forwarded to a rank before its recorder exists stays pending, and `Preemption` unblocks it
once its handlers are installed: delivered then, it is recorded like any other.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def handled(signals: tuple[signal.Signals, ...]) -> list[signal.Signals]:
    """The signals not ignored when the process started: `nohup` (SIGHUP) and a background job of a
    non-interactive shell (SIGINT) keep their meaning."""
    return [sig for sig in signals if signal.getsignal(sig) is not signal.SIG_IGN]


@contextlib.contextmanager
def blocked(signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> Iterator[None]:
    """Block `signals` in this thread for the block's duration; children started inside inherit the mask
    (and keep it across exec). Signals that arrive meanwhile are delivered when it ends."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def before_any_rank(name: str) -> str:
    """The launcher's report of stop signal `name` (SIGINT, ...) received before it started any rank
    (run_train.sh's set-up prints the same words)."""
    return f"{name} before any rank started: nothing was trained"


class Preemption:
    """Records SIGTERM/SIGUSR1 instead of dying, so the trainer can stop at a step boundary.

    With `interrupt` (a command-line run) the first SIGINT is a stop signal too and a second one raises
    `KeyboardInterrupt`: Ctrl-C saves and stops, Ctrl-C twice stops at once. SIGINT is left alone when
    the process was started with it ignored (a background job). Installing it unblocks the stop signals
    (see the module docstring), so one that arrived before is recorded now.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, interrupt: bool = False) -> None:
        self.received: int | None = None
        signals = list(self.SIGNALS)
        if interrupt and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signals.append(signal.SIGINT)
        for sig in signals:
            signal.signal(sig, self._handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    def _handler(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt

    @property
    def name(self) -> str:
        """The recorded signal's name ("" when none was received)."""
        return signal.Signals(self.received).name if self.received is not None else ""
