"""The launcher's rows of the goodput ledger (`metrics/goodput.py`): the time no rank 0 records, and the
line at the end of a launch.

Only the launcher of the node hosting global rank 0 writes: before an attempt starts its ranks
(`attempt`: the launch's start-up, or the `restart` since the failed attempt's last row, with the step
that attempt last finished) and at the launch's end (`end`: `other` after a successful attempt,
`restart` after a failed one), then the job's line (`Totals.line`). Each interval has one writer, so
nothing is counted twice. A launch that ends in bad input prints no line, and one whose rank 0 recorded
nothing withdraws its rows (it may have run beside the launch that uses the folder). A launcher killed
by SIGKILL writes no end. docs/metrics.md#goodput has the categories.
"""

from __future__ import annotations

import time
import uuid

from titanlite.errors import EXIT_USER_ERROR
from titanlite.metrics.goodput import (
    ATTEMPT_ENV,
    Attempt,
    append_row,
    last_end,
    ledger_path,
    process_started,
    read_rows,
    totals,
)


class LaunchLedger:
    """This launch's rows of the ledger of `dump_folder` (module docstring); the launch started at
    `started` (default: this process's start, which is run_train.sh's)."""

    def __init__(self, dump_folder: str, started: float | None = None) -> None:
        self.path = ledger_path(dump_folder)
        self.launch = uuid.uuid4().hex[:12]
        self.started = process_started() if started is None else started
        self.attempts = 0
        self.hosting = False
        """Whether this node hosts rank 0 in the current attempt (then this launcher writes)."""
        self.rows: list[dict] = []
        """Every row this launcher wrote or tried to: the line counts them even where a write failed."""
        self.error = ""

    def attempt(self, hosting: bool, step: int | None) -> dict[str, str]:
        """Before an attempt starts its ranks: its row when this node hosts rank 0 (`hosting`); `step` is
        the step the failed attempt's rank 0 last finished, if known. Returns the ranks' environment."""
        now = time.time()
        number, self.attempts = self.attempts, self.attempts + 1
        self.hosting = hosting
        if not hosting:
            return {}
        if number == 0:
            self._write(f"{self.launch}/launcher/0", self.started, now, "startup", None)
        else:
            self._write(f"{self.launch}/launcher/{number}", self._since(now, self._read()), now, "restart", step)
        return {ATTEMPT_ENV: Attempt(self.launch, number, now).env()}

    def end(self, code: int, step: int | None) -> str | None:
        """At the launch's end (`code`, its exit code): the last row, and the line to print (None where
        no rank started here, or the launch ends in bad input)."""
        if not self.attempts or not self.hosting:
            return None
        now, rows = time.time(), self._read()
        if code == EXIT_USER_ERROR and not any(r["id"].startswith(f"{self.launch}/rank0/") for r in rows):
            for row in list(self.rows):
                self._withdraw(row)
            return None
        category = "other" if code == 0 else "restart"
        self._write(f"{self.launch}/launcher/end", self._since(now, rows), now, category, step)
        if code == EXIT_USER_ERROR:
            return None
        where = f"ledger {self.path}" + (f" not written: {self.error}" if self.error else "")
        return totals(rows + self.rows).line(where)

    def _since(self, now: float, rows: list[dict]) -> float:
        """Where the launcher's next row starts: the end of the newest row of `rows` and its own (the last
        attempt's rank 0, or the launcher's own before it), never after `now`."""
        end = last_end(rows + self.rows)
        return min(end if end is not None else self.started, now)

    def _read(self) -> list[dict]:
        try:
            return read_rows(self.path)
        except OSError:
            return []

    def _write(self, id_: str, start: float, end: float, category: str, step: int | None) -> None:
        row = {"id": id_, "start": round(start, 3), "end": round(end, 3), "seconds": {category: round(end - start, 4)}}
        row["step"] = step or 0
        self.rows.append(row)
        self._append(row)

    def _withdraw(self, row: dict) -> None:
        withdrawn = {**row, "end": row["start"], "seconds": {}, "step": 0}
        self.rows.append(withdrawn)
        self._append(withdrawn)

    def _append(self, row: dict) -> None:
        try:
            append_row(self.path, row)
        except OSError as e:
            self.error = self.error or f"{type(e).__name__}: {e}"
