"""Where rank 0's metrics go: metrics.jsonl, TensorBoard events and a W&B run, behind one fan-out.

Protocol: `Sinks.write(step, row, metrics, values)` appends `row` to metrics.jsonl and sends `metrics`'
values to TensorBoard (scalar events carrying each metric's display name and description) and W&B; the
step line and a held-out evaluation both log through it.

metrics.jsonl: rank 0 appends one row per log; every row carries `run`, the number of the run that
wrote it in this dump folder (`runs.py`: numbered and recorded in runs.jsonl when it starts training),
so the rows of a resumed or restarted run, which repeat the steps since the last checkpoint, can be told
apart. A row is written whole or not at all: a failed write is cut back off the file.

Outputs that fail (a full disk, a file size limit, permissions): metrics.jsonl, TensorBoard and W&B each
get one warning naming the output and the error, and are not written again in this run; training goes
on. (Profiler traces follow the same rule; checkpoints have their own policy, `checkpoint/manager.py`.)
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Callable

from titanlite import faults
from titanlite.errors import ConfigError
from titanlite.metrics.runs import RUNS_FILE, Run
from titanlite.metrics.schema import Metric

logger = logging.getLogger("titanlite")


def wandb_missing() -> bool:
    """Whether the optional `wandb` package is absent (checked without importing it: that takes seconds)."""
    try:
        return importlib.util.find_spec("wandb") is None
    except ValueError:  # sys.modules["wandb"] is None: imports of it are blocked
        return True


def check_wandb(cfg) -> None:
    """`metrics.enable_wandb` needs the package: one line and exit code 2 before anything starts."""
    if cfg.enable_wandb and wandb_missing():
        raise ConfigError(
            "metrics.enable_wandb is set but the wandb package is not installed "
            "(pip install 'titanlite[wandb]', or --no-metrics.enable_wandb)"
        )


class Output:
    """One output of the logger: written until its first failure, which is warned about once; then it is
    left alone for the rest of the run (the policy in the module docstring)."""

    def __init__(self, name: str) -> None:
        self.name, self.ok = name, True

    def write(self, fn: Callable[[], object]) -> None:
        if not self.ok:
            return
        try:
            faults.metrics_write()
            fn()
        except Exception as e:  # OSError, or an output's own wrapper of it
            self.ok = False
            logger.warning(
                f"metrics: cannot write {self.name} ({type(e).__name__}: {e}); nothing more is written "
                "to it in this run, training continues"
            )


class JsonLines:
    """A JSON-lines file of whole rows appended, each tagged with the `run` number given (metrics.jsonl,
    runs.jsonl); `last_run` is the number its last row carries (0 when empty)."""

    def __init__(self, dump_folder: str, name: str) -> None:
        self.name = name
        self.path = os.path.join(dump_folder, name)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.size = os.fstat(self.fd).st_size
        last = self._last_row()
        self.last_run = int(last.get("run", 1 if last else 0))
        self.run = self.last_run + 1

    def _last_row(self) -> dict:
        """The file's last complete row ({} when empty); a torn row at its end (a crash mid-write) is cut."""
        with open(self.path, "rb") as f:
            f.seek(max(0, self.size - (1 << 16)))
            tail = f.read()
        if tail and not tail.endswith(b"\n"):
            cut = len(tail) - tail.rfind(b"\n") - 1
            logger.info(f"metrics: {self.path}: dropped a torn last row ({cut} bytes)")
            self.size -= cut
            os.ftruncate(self.fd, self.size)
            tail = tail[: len(tail) - cut]
        for line in reversed(tail.splitlines()):
            try:
                return json.loads(line)
            except ValueError:
                continue
        return {}

    def append(self, row: dict) -> None:
        data = memoryview((json.dumps({**row, "run": self.run}) + "\n").encode())
        try:
            while data:
                data = data[os.write(self.fd, data) :]
        except OSError:
            os.ftruncate(self.fd, self.size)  # no torn row
            raise
        self.size = os.fstat(self.fd).st_size

    def close(self) -> None:
        os.close(self.fd)


class Sinks:
    """Rank 0's outputs: metrics.jsonl always, TensorBoard and W&B when opened; each written by the failure
    policy of the module docstring."""

    METRICS_FILE, TENSORBOARD, WANDB = "metrics.jsonl", "TensorBoard events", "the W&B run"

    def __init__(self, dump_folder: str, run: Run) -> None:
        """Opens metrics.jsonl and records `run` in runs.jsonl under the next number of this dump folder."""
        names = (self.METRICS_FILE, RUNS_FILE, self.TENSORBOARD, self.WANDB)
        self.outputs = {name: Output(name) for name in names}
        self.writer = None
        self.wandb_run = None
        self._described: set[str] = set()  # tags whose TensorBoard metadata was written
        os.makedirs(dump_folder, exist_ok=True)
        self.jsonl: JsonLines | None = JsonLines(dump_folder, self.METRICS_FILE)
        runs = JsonLines(dump_folder, RUNS_FILE)
        self.run = run.numbered(max(self.jsonl.last_run, runs.last_run) + 1)
        self.jsonl.run = runs.run = self.run.number
        self.outputs[RUNS_FILE].write(lambda: runs.append(self.run.row()))
        runs.close()
        path, number = os.path.abspath(self.jsonl.path), self.run.number
        logger.info(f"metrics: {path} (run {number} in this file: {self.run.name}, listed in {RUNS_FILE})")

    def open_tensorboard(self, dump_folder: str, tb_folder: str, layout: dict) -> None:
        """An events file under `<dump_folder>/<tb_folder>/<run name>/` with the custom-scalars `layout`
        (written on this thread, so a full disk is this output's one warning: `event_file.py`)."""
        from torch.utils.tensorboard.summary import custom_scalars

        from titanlite.metrics.event_file import EventFile

        log_dir = os.path.join(dump_folder, tb_folder, self.run.name)

        def open_tensorboard() -> None:
            self.writer = EventFile(log_dir)
            self.writer.summaries([custom_scalars(layout)], 0)

        logger.info(f"TensorBoard events: {log_dir}")
        self.outputs[self.TENSORBOARD].write(open_tensorboard)

    def open_wandb(self, cfg, dump_folder: str, run_config: dict | None) -> None:
        """A W&B run in `cfg.wandb_project` (the `metrics` config), recording `run_config`."""
        check_wandb(cfg)
        import wandb

        def open_wandb() -> None:
            self.wandb_run = wandb.init(
                project=cfg.wandb_project,
                name=cfg.wandb_run_name or os.path.basename(os.path.abspath(dump_folder)),
                dir=None if os.environ.get("WANDB_DIR") else dump_folder,  # the user's WANDB_DIR wins
                config=run_config,
            )

        self.outputs[self.WANDB].write(open_wandb)
        if self.wandb_run is not None:
            mode = os.environ.get("WANDB_MODE", "online")
            logger.info(f"Weights & Biases run: {self.wandb_run.name} ({mode})")

    def write(self, step: int, row: dict, metrics: list[Metric], values: dict) -> None:
        """One row to metrics.jsonl, and `metrics`' values to TensorBoard and W&B."""
        assert self.jsonl is not None
        jsonl = self.jsonl
        self.outputs[self.METRICS_FILE].write(lambda: jsonl.append(row))
        scalars = {m.tag: values[m.name] for m in metrics if values.get(m.name) is not None}
        if (writer := self.writer) is not None:
            summaries = [self._summary(m, scalars[m.tag]) for m in metrics if m.tag in scalars]
            self.outputs[self.TENSORBOARD].write(lambda: writer.summaries(summaries, step))
        if self.wandb_run is not None:
            self.outputs[self.WANDB].write(lambda: self.wandb_run.log(scalars, step=step))

    def _summary(self, m: Metric, value: float):
        """A scalar event as TensorBoard's own scalar summaries are: a float tensor whose first event per
        tag carries the scalars plugin's metadata with the display name and description (add_scalar
        cannot set them)."""
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.types_pb2 import DT_FLOAT
        from tensorboard.plugins.scalar.metadata import create_summary_metadata

        tensor = TensorProto(dtype=DT_FLOAT, float_val=[float(value)])
        if m.tag in self._described:
            return Summary(value=[Summary.Value(tag=m.tag, tensor=tensor)])
        self._described.add(m.tag)
        metadata = create_summary_metadata(display_name=m.display_name, description=m.description)
        return Summary(value=[Summary.Value(tag=m.tag, tensor=tensor, metadata=metadata)])

    def close(self) -> None:
        if self.writer is not None:
            self.outputs[self.TENSORBOARD].write(self.writer.close)
            self.writer = None
        if self.wandb_run is not None:
            self.outputs[self.WANDB].write(self.wandb_run.finish)
            self.wandb_run = None
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
