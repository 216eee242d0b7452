"""The launcher's rows of the goodput ledger (`metrics/goodput.py`): the time no rank 0 records, and the
line at the end of a launch.

The launcher of the node that hosts global rank 0 writes (the other nodes' launchers write nothing):

* before an attempt starts its ranks (`attempt`), the time since the launch started (the first attempt:
  `startup`, run_train.sh, the preflight, the rendezvous) or since the failed attempt's last row
  (`restart`: the failing step, the failure's detection, such as a hang's window, stopping the ranks,
  the rendezvous); the new attempt's rank 0 records from then on, its own start-up and checkpoint load
  included, so nothing is counted twice. A row after a failed attempt carries the step that attempt's
  rank 0 last finished (its progress file): the next attempt counts steps up to it as recomputed.
* at the launch's end (`end`), the time since the last attempt's last row: `other` after a successful
  attempt (the ranks' exit), `restart` after a failed or killed one. Then the line, `Totals.line`, for
  the whole job (every launch and restart in the dump folder).

A launch that ends in bad input (exit code 2) prints no line, as bad input is one line; if its rank 0
recorded nothing (a dump folder in use by another run, a refused resume), it withdraws its rows (rows of
an id replace each other: the withdrawal holds no time), since it trained nothing and may have run
beside the launch that uses the folder, whose time it would count again. A launcher killed by SIGKILL
writes no end: the ledger lacks the time since its last row.
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
