"""A TensorBoard event file written on the calling thread.

TensorBoard's own writer (`SummaryWriter`, `EventFileWriter`) hands every event to a background thread.
When a write fails there (a full disk: ENOSPC), that thread dies with its traceback printed by Python
(17 lines of "Exception in thread ...") and the error reaches the caller only at its next write. The
trainer flushes its events at every log anyway, so the thread buys nothing: here each `write` appends
the events' records (TensorBoard's framing, `RecordWriter`) and flushes them at once, so a failure is an
OSError of that call, which the metrics sinks turn into their one warning (`sinks.Output`).
"""

from __future__ import annotations

import os
import socket
import time

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.record_writer import RecordWriter


class EventFile:
    """`<log_dir>/events.out.tfevents.<time>.<host>.<pid>`: events written and flushed synchronously."""

    def __init__(self, log_dir: str) -> None:
        os.makedirs(log_dir, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.0"
        self.path = os.path.join(log_dir, name)
        self._file = open(self.path, "wb")  # noqa: SIM115 (open until close())
        self._records = RecordWriter(self._file)
        self.write([Event(wall_time=time.time(), file_version="brain.Event:2")])

    def write(self, events: list[Event]) -> None:
        """Append `events` and flush them to the file (an OSError on a full disk, here)."""
        for event in events:
            self._records.write(event.SerializeToString())
        self._records.flush()

    def summaries(self, summaries: list[Summary], step: int) -> None:
        """One event per summary, at `step`."""
        now = time.time()
        self.write([Event(wall_time=now, step=step, summary=s) for s in summaries])

    def close(self) -> None:
        self._file.close()
