"""The peak compute rate MFU is measured against, and MFU itself.

The peak is `metrics.peak_tflops` when set, else the GPU's dense bf16 peak for known GPUs (vendor data
sheets), else on CPU the fp32 matmul rate of this machine: the fastest of repeated 1024 x 1024 matmuls
with the process's threads, taken once and cached per CPU model, core and thread count and torch version
(`CPU_PEAK_CACHE`; delete it to measure again). The fastest repetition, not the mean, so that other work
on a shared machine lowers it as little as possible. A measurement can still come out low (a machine busy
throughout), and no step can truly beat the peak: when a logged step's rate exceeds it, the peak is
raised to that rate (logged once, and cached for a measured CPU peak), so MFU never exceeds 100%.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import platform
import time

import torch

from titanlite.planning.gpus import GPU_PEAK_TFLOPS

logger = logging.getLogger("titanlite")

CPU_PEAK_CACHE = os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "titanlite", "cpu_peak_tflops.json"
)
_MATMUL = 1024
_MEASURE_SECONDS = 0.5
_MIN_REPS = 5


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
    return _cpu_peak_tflops(), f"CPU fp32 matmul peak, fastest of repeated {_MATMUL}^3 matmuls ({CPU_PEAK_CACHE})"


def _cpu_key() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model} | {os.cpu_count()} cpus | {torch.get_num_threads()} threads | torch {torch.__version__}"


def _read_cache() -> dict:
    try:
        with open(CPU_PEAK_CACHE) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _write_cache(peak: float) -> None:
    """Record this machine's peak (best effort: a read-only home only costs a measurement at each start)."""
    try:
        os.makedirs(os.path.dirname(CPU_PEAK_CACHE), exist_ok=True)
        tmp = f"{CPU_PEAK_CACHE}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({**_read_cache(), _cpu_key(): peak}, f, indent=1)
        os.replace(tmp, CPU_PEAK_CACHE)
    except OSError:
        pass


@functools.cache
def _cpu_peak_tflops() -> float:
    """The cached peak for this machine, else measured now and cached."""
    cached = _read_cache().get(_cpu_key())
    if cached is not None:
        return float(cached)
    peak = _measure_cpu_peak_tflops()
    _write_cache(peak)
    return peak


def _measure_cpu_peak_tflops() -> float:
    a, b = torch.randn(_MATMUL, _MATMUL), torch.randn(_MATMUL, _MATMUL)
    a @ b  # warm-up
    best, reps, deadline = math.inf, 0, time.perf_counter() + _MEASURE_SECONDS
    while reps < _MIN_REPS or time.perf_counter() < deadline:
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
        reps += 1
    return 2 * _MATMUL**3 / best / 1e12


class Peak:
    """The peak a run's MFU is measured against (module docstring), raised to any faster logged step."""

    def __init__(self, configured: float, device: torch.device) -> None:
        if configured:
            self.tflops, self.source = configured, "metrics.peak_tflops"
        else:
            self.tflops, self.source = peak_tflops(device)
        self.measured_cpu = not configured and device.type != "cuda"

    def mfu(self, tflops: float) -> float | None:
        """MFU in percent of the peak, after raising the peak to `tflops` if that is above it."""
        if self.tflops is not None and tflops > self.tflops:
            logger.info(
                f"MFU peak raised from {self.tflops:.3g} to {tflops:.3g} TFLOP/s: a step ran faster than "
                f"the peak ({self.source})"
            )
            self.tflops, self.source = tflops, f"raised to the fastest step's rate; was {self.source}"
            if self.measured_cpu:
                _write_cache(tflops)
        return mfu_pct(tflops, self.tflops)
