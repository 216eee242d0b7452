"""Training metrics: console line, metrics.jsonl, TensorBoard scalars and W&B, written by rank 0.

Memory: on CUDA the caching allocator's peak allocated/reserved bytes since the last log; on CPU the
process's peak resident set size (`VmHWM`, reset after every log through /proc/self/clear_refs).
MFU: against the peak of `mfu.py` (the log says which), never above 100%.
Every scalar is declared once in `METRICS` (name, group, display name, unit, description): the
metrics.jsonl key, the TensorBoard tag and its custom layout, and the W&B key all come from it; each
TensorBoard scalar carries the scalars plugin's metadata with its display name and description.

metrics.jsonl: rank 0 appends one row per log; every row carries `run`, the number of the trainer start
that wrote it in this dump folder (1, 2, ... counted from the file's last row), so the rows of a resumed
or restarted run, which repeat the steps since the last checkpoint, can be told apart. A row is written
whole or not at all: a failed write is cut back off the file.

Outputs that fail (a full disk, a file size limit, permissions): metrics.jsonl, TensorBoard and W&B each
get one warning naming the output and the error, and are not written again in this run; training goes
on. (Profiler traces follow the same rule; checkpoints have their own policy, `checkpoint/manager.py`.)
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from titanlite import faults
from titanlite.errors import ConfigError
from titanlite.mfu import Peak, mfu_pct, peak_tflops

__all__ = ["METRICS", "MetricsLogger", "StepStats", "mfu_pct", "peak_tflops"]  # the MFU helpers, for benchmarks

logger = logging.getLogger("titanlite")


@dataclass(frozen=True)
class ValidationResult:
    """One evaluation's result (`validation.Validator.run`), as `MetricsLogger.log_validation` records it."""

    loss: float
    """Mean token cross-entropy over the held-out batches and the data-parallel ranks."""
    seconds: float
    """Wall time of the evaluation (the trainer leaves it out of the training throughput)."""
    tokens: int
    """Tokens evaluated, all data-parallel ranks together."""

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))  # exp overflows a float beyond ~709


class MemoryMonitor:
    """Peak memory since the last `reset()`, in GiB."""

    def __init__(self, device: torch.device):
        self.device = device
        self.kind = "cuda max allocated" if device.type == "cuda" else "cpu peak RSS (VmHWM)"
        self.capacity = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        self.reset()

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                pass

    def peak_gib(self) -> tuple[float, float | None]:
        """(peak GiB, peak reserved GiB on CUDA / None on CPU)."""
        if self.device.type == "cuda":
            return (
                torch.cuda.max_memory_allocated(self.device) / 2**30,
                torch.cuda.max_memory_reserved(self.device) / 2**30,
            )
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) / 2**20, None
        except OSError:
            pass
        return 0.0, None


@dataclass(frozen=True)
class Metric:
    """One logged scalar: its name (the metrics.jsonl key), chart group, display name, unit, description.

    The TensorBoard tag and the W&B key are `<group>/<name>`: one name per metric everywhere."""

    name: str
    group: str
    title: str
    unit: str
    description: str
    cuda_only: bool = False
    validation: bool = False
    """Written by a held-out evaluation (its own metrics.jsonl row), not by the step line."""

    @property
    def tag(self) -> str:
        return f"{self.group}/{self.name}"

    @property
    def display_name(self) -> str:
        return f"{self.title} ({self.unit})" if self.unit else self.title


METRICS = (
    Metric("loss", "loss", "Training loss", "nats/token", "Cross-entropy of the step's batch, mean over dp ranks."),
    Metric("grad_norm", "loss", "Gradient norm", "", "Global L2 norm of the gradients, before clipping."),
    Metric("lr", "loss", "Learning rate", "", "The learning rate of the step (after warmup/decay)."),
    Metric(
        "tps",
        "throughput",
        "Throughput",
        "tokens/s per GPU",
        "The global batch's tokens over the world size and the step time (tp ranks share their tokens).",
    ),
    Metric("tflops", "throughput", "Achieved compute", "TFLOP/s per GPU", "Model FLOPs (6N + attention) per second."),
    Metric("mfu_pct", "throughput", "MFU", "% of peak", "Achieved TFLOP/s over the device's peak (see the log)."),
    Metric("mem_peak_gib", "memory", "Peak memory", "GiB", "CUDA max allocated, or CPU peak RSS, since last log."),
    Metric("mem_reserved_gib", "memory", "Peak reserved", "GiB", "CUDA caching allocator's peak reserved.", True),
    Metric("mem_pct", "memory", "Peak reserved", "% of GPU memory", "Peak reserved over the GPU's capacity.", True),
    Metric("data_pct", "time", "Data loading", "% of step time", "Time spent waiting for the next batch."),
    Metric("step_time_s", "time", "Step time", "s", "Wall time per optimizer step, averaged since the last log."),
    Metric(
        "val_loss",
        "validation",
        "Validation loss",
        "nats/token",
        "Mean cross-entropy of the held-out batches.",
        validation=True,
    ),
    Metric("val_ppl", "validation", "Validation perplexity", "", "exp(validation loss).", validation=True),
)
"""Every scalar the logger writes, in chart order; the TensorBoard custom layout is built from it."""

RENAMED = {"mfu": "mfu_pct", "data_time_pct": "data_pct"}
"""metrics.jsonl keys renamed to the shared names; the old keys are still written (same values) for one
release, then dropped."""


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


def clock(seconds: float) -> str:
    """`H:MM:SS` for the step line's elapsed time and ETA."""
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


@dataclass
class StepStats:
    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: float
    """Tokens per GPU since the last log: the global batch's tokens over the world size."""
    elapsed: float
    data_time: float


COLORS = dict(
    red="\033[31m",
    green="\033[32m",
    yellow="\033[33m",
    blue="\033[34m",
    cyan="\033[36m",
    magenta="\033[35m",
    reset="\033[39m",
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
    """metrics.jsonl: whole rows appended, each tagged with this trainer start's `run` number."""

    NAME = "metrics.jsonl"

    def __init__(self, dump_folder: str) -> None:
        self.path = os.path.join(dump_folder, self.NAME)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.size = os.fstat(self.fd).st_size
        last = self._last_row()
        self.run = int(last.get("run", 1 if last else 0)) + 1

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


class MetricsLogger:
    """Rank 0's console step line, metrics.jsonl, TensorBoard events and (optionally) W&B run.

    `run_config` (the whole config as a dict) is recorded with the W&B run; `validation` adds the
    held-out metrics to the TensorBoard layout."""

    def __init__(
        self,
        cfg,
        dump_folder: str,
        device: torch.device,
        flops_per_token: float,
        enabled: bool,
        run_config: dict | None = None,
        validation: bool = False,
    ):
        self.cfg, self.enabled, self.flops_per_token = cfg, enabled, flops_per_token
        self.memory = MemoryMonitor(device)
        self.peak = Peak(cfg.peak_tflops, device) if enabled else None
        self.metrics = [m for m in METRICS if (device.type == "cuda" or not m.cuda_only) and not m.validation]
        self.val_metrics = [m for m in METRICS if m.validation] if validation else []
        self.writer = None
        self.wandb_run = None
        self.jsonl: JsonLines | None = None
        self.outputs = {name: Output(name) for name in (JsonLines.NAME, "TensorBoard events", "the W&B run")}
        self._described: set[str] = set()  # tags whose TensorBoard metadata was written
        self.total_steps = 0
        self.start: tuple[float, int] | None = None  # (time, step) of the first log: the ETA's rate
        self.began = time.perf_counter()
        # Colours only for a person at a terminal: log files and pipes get plain text.
        color = not cfg.disable_color_printing and sys.stderr.isatty()
        self.c = {k: (v if color else "") for k, v in COLORS.items()}
        if not enabled:
            return
        os.makedirs(dump_folder, exist_ok=True)
        self.jsonl = JsonLines(dump_folder)
        logger.info(f"metrics: {os.path.abspath(self.jsonl.path)} (run {self.jsonl.run} in this file)")
        peak = f"{self.peak.tflops:.2f} TFLOP/s ({self.peak.source})" if self.peak.tflops else self.peak.source
        logger.info(f"MFU peak: {peak}; memory: {self.memory.kind}")
        if self.peak.tflops is None:
            self.metrics = [m for m in self.metrics if m.name != "mfu_pct"]
        if cfg.enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            log_dir = os.path.join(dump_folder, cfg.save_tb_folder, time.strftime("%Y%m%d-%H%M%S"))

            def open_tensorboard() -> None:
                self.writer = SummaryWriter(log_dir)
                self.writer.add_custom_scalars(self.layout())

            logger.info(f"TensorBoard events: {log_dir}")
            self._tensorboard(open_tensorboard)
        if cfg.enable_wandb:
            check_wandb(cfg)
            import wandb

            def open_wandb() -> None:
                self.wandb_run = wandb.init(
                    project=cfg.wandb_project,
                    name=cfg.wandb_run_name or os.path.basename(os.path.abspath(dump_folder)),
                    dir=None if os.environ.get("WANDB_DIR") else dump_folder,  # the user's WANDB_DIR wins
                    config=run_config,
                )

            self.outputs["the W&B run"].write(open_wandb)
            if self.wandb_run is not None:
                mode = os.environ.get("WANDB_MODE", "online")
                logger.info(f"Weights & Biases run: {self.wandb_run.name} ({mode})")

    def _tensorboard(self, fn: Callable[[], object]) -> None:
        self.outputs["TensorBoard events"].write(fn)

    def layout(self) -> dict:
        """The TensorBoard custom-scalars layout: one category per group, one chart per logged metric,
        titled with its display name and unit."""
        groups: dict = {}
        for m in self.metrics + self.val_metrics:
            groups.setdefault(m.group, {})[m.display_name] = ["Multiline", [m.tag]]
        return groups

    def begin(self, step: int, total_steps: int) -> None:
        """Training starts after `step` (0, or the resumed step) and ends at `total_steps`."""
        self.total_steps, self.began = total_steps, time.perf_counter()

    def _eta(self, step: int, window_step_s: float) -> float:
        """Seconds left: the mean step time since the first log (which includes compilation, so it is
        left out), or the current window's before there are two logs."""
        now = time.perf_counter()
        if self.start is None:
            self.start = (now, step)
        t0, s0 = self.start
        per_step = (now - t0) / (step - s0) if step > s0 else window_step_s
        return per_step * max(self.total_steps - step, 0)

    def log(self, s: StepStats, n_steps: int) -> dict:
        tps = s.tokens / max(s.elapsed, 1e-9)
        tflops = self.flops_per_token * tps / 1e12
        mem, reserved = self.memory.peak_gib()
        record = dict(
            step=s.step,
            loss=s.loss,
            grad_norm=s.grad_norm,
            lr=s.lr,
            tps=tps,
            tflops=tflops,
            mfu_pct=self.peak.mfu(tflops) if self.peak is not None else None,
            mem_peak_gib=mem,
            data_pct=100.0 * s.data_time / max(s.elapsed, 1e-9),
            step_time_s=s.elapsed / max(n_steps, 1),
        )
        if reserved is not None:
            record["mem_reserved_gib"] = reserved
            record["mem_pct"] = 100.0 * reserved * 2**30 / self.memory.capacity
        self.memory.reset()
        if not self.enabled:
            return record
        c = self.c
        total = self.total_steps or s.step
        elapsed = time.perf_counter() - self.began
        eta = self._eta(s.step, record["step_time_s"])
        mfu = "n/a" if record["mfu_pct"] is None else format(record["mfu_pct"], ".2f") + "%"
        logger.info(
            f"{c['red']}step {s.step:>{len(str(total))}d}/{total}  {c['green']}loss: {s.loss:8.4f}  "
            f"{c['yellow']}grad_norm: {s.grad_norm:7.4f}  "
            f"{c['cyan']}lr: {s.lr:.3e}  {c['blue']}memory: {mem:5.2f}GiB  "
            f"{c['magenta']}tps: {tps:,.0f}  tflops: {tflops:.3f}  mfu: {mfu}  "
            f"data: {record['data_pct']:.1f}%{c['reset']}  elapsed {clock(elapsed)}  eta {clock(eta)}"
        )
        legacy = {old: record[new] for old, new in RENAMED.items()}
        self._write(s.step, {**record, **legacy}, self.metrics, record)
        return record

    def _write(self, step: int, row: dict, metrics: list[Metric], values: dict) -> None:
        """One row to metrics.jsonl, and `metrics`' values to TensorBoard and W&B (each output by the
        failure policy of the module docstring)."""
        assert self.jsonl is not None
        self.outputs[JsonLines.NAME].write(lambda: self.jsonl.append(row))
        scalars = {m.tag: values[m.name] for m in metrics if values.get(m.name) is not None}
        if self.writer is not None:

            def tensorboard() -> None:
                writer = self.writer._get_file_writer()
                for m in metrics:
                    if m.tag in scalars:
                        writer.add_summary(self._summary(m, scalars[m.tag]), step)
                self.writer.flush()

            self._tensorboard(tensorboard)
        if self.wandb_run is not None:
            self.outputs["the W&B run"].write(lambda: self.wandb_run.log(scalars, step=step))

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

    def log_validation(self, step: int, result: ValidationResult) -> dict:
        """A held-out evaluation: its own console line, `metrics.jsonl` row (`step`, `val_loss`, `val_ppl`,
        `val_tokens`, `val_time_s`; no `loss` key) and `validation/` TensorBoard scalars."""
        record = dict(
            step=step,
            val_loss=result.loss,
            val_ppl=result.perplexity,
            val_tokens=result.tokens,
            val_time_s=result.seconds,
        )
        if not self.enabled:
            return record
        c = self.c
        logger.info(
            f"{c['red']}step: {step:5d}  {c['green']}val_loss: {result.loss:8.4f}  val_ppl: {result.perplexity:,.2f}  "
            f"{c['magenta']}({result.tokens:,} held-out tokens in {result.seconds:.2f}s){c['reset']}"
        )
        self._write(step, record, self.val_metrics, record)
        return record

    def close(self) -> None:
        if self.writer is not None:
            self._tensorboard(self.writer.close)
            self.writer = None
        if self.wandb_run is not None:
            self.outputs["the W&B run"].write(self.wandb_run.finish)
            self.wandb_run = None
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
