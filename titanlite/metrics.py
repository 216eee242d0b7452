"""Training metrics: console line, TensorBoard scalars and metrics.jsonl, written by rank 0.

Memory: on CUDA the caching allocator's peak allocated/reserved bytes since the last log; on CPU the
process's peak resident set size (`VmHWM`, reset after every log through /proc/self/clear_refs).
MFU: against `metrics.peak_tflops` when set, else the GPU's dense bf16 peak for known GPUs, else on CPU
against a peak fp32 matmul rate measured once per machine and cached (the log says which).
Every scalar is declared once in `METRICS` (name, group, display name, unit, description): the
metrics.jsonl key, the TensorBoard tag and its custom layout, and the W&B key all come from it.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import platform
import sys
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from titanlite.errors import ConfigError

logger = logging.getLogger("titanlite")

# Dense bf16 peak TFLOP/s (no sparsity) per GPU name fragment, most specific first: the first fragment
# found in the device name wins, so "GB200" must precede "B200" and the H100 variants the plain "H100"
# (SXM). Vendor data sheets.
GPU_PEAK_TFLOPS = {
    "GB200": 2500.0,
    "B200": 2250.0,
    "H200": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "A10G": 125.0,
    "MI325X": 1307.0,
    "MI300X": 1307.0,
}


def mfu_pct(tflops: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation in percent; None where the device's peak is unknown."""
    return 100.0 * tflops / peak if peak else None


def peak_tflops(device: torch.device) -> tuple[float | None, str]:
    """(peak TFLOP/s, where it comes from); None for a GPU the table does not know (MFU is then not
    reported rather than computed against a guessed peak)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in GPU_PEAK_TFLOPS.items():
            if key in name:
                return value, f"{name} bf16 dense peak"
        return None, f"unknown GPU {name}: MFU not reported"
    return _cpu_peak_tflops(), f"CPU fp32 matmul peak, measured once on this machine ({CPU_PEAK_CACHE})"


# The measured CPU peak, per CPU model, core count, thread count and torch version: measured once per
# machine, so MFU does not drift between runs with timing noise (re-measured after deleting the file).
CPU_PEAK_CACHE = os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "titanlite", "cpu_peak_tflops.json"
)


def _cpu_key() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model} | {os.cpu_count()} cpus | {torch.get_num_threads()} threads | torch {torch.__version__}"


@functools.cache
def _cpu_peak_tflops() -> float:
    """The cached peak for this machine, else measured now and cached (best effort: a read-only home
    only costs the measurement at each start)."""
    key = _cpu_key()
    try:
        with open(CPU_PEAK_CACHE) as f:
            cached = json.load(f)
        if key in cached:
            return float(cached[key])
    except (OSError, ValueError):
        cached = {}
    peak = _measure_cpu_peak_tflops()
    try:
        os.makedirs(os.path.dirname(CPU_PEAK_CACHE), exist_ok=True)
        tmp = f"{CPU_PEAK_CACHE}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({**cached, key: peak}, f, indent=1)
        os.replace(tmp, CPU_PEAK_CACHE)
    except OSError:
        pass
    return peak


def _measure_cpu_peak_tflops() -> float:
    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.25:
        a @ b
        reps += 1
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e12


class ValidationResult(Protocol):
    """What `log_validation` reads of `titanlite.validation.ValidationResult` (that module sits above this one)."""

    loss: float
    seconds: float
    tokens: int

    @property
    def perplexity(self) -> float: ...


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
        self.peak, self.peak_source = (None, "")
        if enabled:
            self.peak, self.peak_source = (
                (cfg.peak_tflops, "metrics.peak_tflops") if cfg.peak_tflops else peak_tflops(device)
            )
        self.metrics = [m for m in METRICS if (device.type == "cuda" or not m.cuda_only) and not m.validation]
        self.val_metrics = [m for m in METRICS if m.validation] if validation else []
        self.writer = None
        self.wandb_run = None
        self.jsonl = None
        self.total_steps = 0
        self.start: tuple[float, int] | None = None  # (time, step) of the first log: the ETA's rate
        self.began = time.perf_counter()
        # Colours only for a person at a terminal: log files and pipes get plain text.
        color = not cfg.disable_color_printing and sys.stderr.isatty()
        self.c = {k: (v if color else "") for k, v in COLORS.items()}
        if not enabled:
            return
        os.makedirs(dump_folder, exist_ok=True)
        self.jsonl = open(os.path.join(dump_folder, "metrics.jsonl"), "a")
        peak = f"{self.peak:.2f} TFLOP/s ({self.peak_source})" if self.peak else self.peak_source
        logger.info(f"MFU peak: {peak}; memory: {self.memory.kind}")
        if self.peak is None:
            self.metrics = [m for m in self.metrics if m.name != "mfu_pct"]
        if cfg.enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            log_dir = os.path.join(dump_folder, cfg.save_tb_folder, time.strftime("%Y%m%d-%H%M%S"))
            self.writer = SummaryWriter(log_dir)
            self.writer.add_custom_scalars(self.layout())
            logger.info(f"TensorBoard events: {log_dir}")
        if cfg.enable_wandb:
            check_wandb(cfg)
            import wandb

            self.wandb_run = wandb.init(
                project=cfg.wandb_project,
                name=cfg.wandb_run_name or os.path.basename(os.path.abspath(dump_folder)),
                dir=None if os.environ.get("WANDB_DIR") else dump_folder,  # the user's WANDB_DIR wins
                config=run_config,
            )
            logger.info(f"Weights & Biases run: {self.wandb_run.name} ({os.environ.get('WANDB_MODE', 'online')})")

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
            mfu_pct=mfu_pct(tflops, self.peak),
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
        self.jsonl.write(json.dumps({**record, **legacy}) + "\n")
        self.jsonl.flush()
        scalars = {m.tag: record[m.name] for m in self.metrics if record.get(m.name) is not None}
        if self.writer is not None:
            writer = self.writer._get_file_writer()
            for m in self.metrics:
                if m.tag in scalars:
                    writer.add_summary(self._summary(m, scalars[m.tag]), s.step)
            self.writer.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=s.step)
        return record

    @staticmethod
    def _summary(m: Metric, value: float):
        """A scalar event carrying its display name and description (TensorBoard shows them; add_scalar
        cannot set them)."""
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata

        metadata = SummaryMetadata(display_name=m.display_name, summary_description=m.description)
        return Summary(value=[Summary.Value(tag=m.tag, simple_value=float(value), metadata=metadata)])

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
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        scalars = {m.tag: record[m.name] for m in self.val_metrics}
        if self.writer is not None:
            writer = self.writer._get_file_writer()
            for m in self.val_metrics:
                writer.add_summary(self._summary(m, record[m.name]), step)
            self.writer.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=step)
        return record

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
        if self.jsonl is not None:
            self.jsonl.close()
