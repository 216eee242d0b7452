"""Training metrics: console line, TensorBoard scalars and metrics.jsonl, written by rank 0.

Memory: on CUDA the caching allocator's peak allocated/reserved bytes since the last log; on CPU the
process's peak resident set size (`VmHWM`, reset after every log through /proc/self/clear_refs).
MFU: against the GPU's dense bf16 peak for known GPUs; on CPU against a peak fp32 matmul rate measured
once at start-up by a short probe (the log says so).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import time
from dataclasses import dataclass
from typing import Protocol

import torch

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


class MetricsLogger:
    def __init__(
        self,
        cfg,
        dump_folder: str,
        device: torch.device,
        flops_per_token: float,
        enabled: bool,
        validation: bool = False,
    ):
        self.cfg, self.enabled, self.flops_per_token = cfg, enabled, flops_per_token
        self.memory = MemoryMonitor(device)
        self.peak, self.peak_source = peak_tflops(device) if enabled else (None, "")
        self.writer = None
        self.jsonl = None
        color = not cfg.disable_color_printing
        self.c = {
            k: (v if color else "")
            for k, v in dict(
                red="\033[31m",
                green="\033[32m",
                yellow="\033[33m",
                blue="\033[34m",
                cyan="\033[36m",
                magenta="\033[35m",
                reset="\033[39m",
            ).items()
        }
        if not enabled:
            return
        os.makedirs(dump_folder, exist_ok=True)
        self.jsonl = open(os.path.join(dump_folder, "metrics.jsonl"), "a")
        peak = f"{self.peak:.2f} TFLOP/s ({self.peak_source})" if self.peak else self.peak_source
        logger.info(f"MFU peak: {peak}; memory: {self.memory.kind}")
        if cfg.enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            log_dir = os.path.join(dump_folder, cfg.save_tb_folder, time.strftime("%Y%m%d-%H%M%S"))
            self.writer = SummaryWriter(log_dir)
            self.writer.add_custom_scalars(
                {
                    "loss": {"loss": ["Multiline", ["loss/loss"]], "grad_norm": ["Multiline", ["loss/grad_norm"]]},
                    "throughput": {
                        "tps": ["Multiline", ["throughput/tps"]],
                        "mfu": ["Multiline", ["throughput/mfu_pct"]],
                    },
                    "memory": {"peak": ["Multiline", ["memory/peak_gib"]]},
                    "time": {"data": ["Multiline", ["time/data_pct"]], "step": ["Multiline", ["time/step_s"]]},
                    **(
                        {
                            "validation": {
                                "loss": ["Multiline", ["validation/loss"]],
                                "perplexity": ["Multiline", ["validation/ppl"]],
                            }
                        }
                        if validation
                        else {}
                    ),
                }
            )
            logger.info(f"TensorBoard events: {log_dir}")

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
            mfu=mfu_pct(tflops, self.peak),
            mem_peak_gib=mem,
            data_time_pct=100.0 * s.data_time / max(s.elapsed, 1e-9),
            step_time_s=s.elapsed / max(n_steps, 1),
        )
        if reserved is not None:
            record["mem_reserved_gib"] = reserved
            record["mem_pct"] = 100.0 * reserved * 2**30 / self.memory.capacity
        self.memory.reset()
        if not self.enabled:
            return record
        c = self.c
        logger.info(
            f"{c['red']}step: {s.step:5d}  {c['green']}loss: {s.loss:8.4f}  "
            f"{c['yellow']}grad_norm: {s.grad_norm:7.4f}  "
            f"{c['cyan']}lr: {s.lr:.3e}  {c['blue']}memory: {mem:5.2f}GiB  "
            f"{c['magenta']}tps: {tps:,.0f}  tflops: {tflops:.3f}  "
            f"mfu: {'n/a' if record['mfu'] is None else format(record['mfu'], '.2f') + '%'}  "
            f"data: {record['data_time_pct']:.1f}%{c['reset']}"
        )
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.writer is not None:
            for tag, key in (
                ("loss/loss", "loss"),
                ("loss/grad_norm", "grad_norm"),
                ("loss/lr", "lr"),
                ("throughput/tps", "tps"),
                ("throughput/tflops", "tflops"),
                ("throughput/mfu_pct", "mfu"),
                ("memory/peak_gib", "mem_peak_gib"),
                ("time/data_pct", "data_time_pct"),
                ("time/step_s", "step_time_s"),
            ):
                if record[key] is not None:
                    self.writer.add_scalar(tag, record[key], s.step)
            self.writer.flush()
        return record

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
        if self.writer is not None:
            self.writer.add_scalar("validation/loss", result.loss, step)
            self.writer.add_scalar("validation/ppl", result.perplexity, step)
            self.writer.flush()
        return record

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()
