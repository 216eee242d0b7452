"""Rank 0's metrics logger: the console step line and what each log writes (`sinks.py`).

A step's metrics: loss, gradient norm, LR, throughput, achieved TFLOP/s and MFU (against the peak of
`mfu.py`, the log says which, never above 100%), peak memory of the window (`peak_memory.py`), data-loading
share, step time; the step line adds the elapsed time and an ETA. A held-out evaluation gets its own line
and row. Every scalar is declared in `schema.METRICS`; the step line and the evaluation both write through
one fan-out (`sinks.Sinks.write`).
"""

from __future__ import annotations

import logging
import sys
import time

import torch

from titanlite.metrics.mfu import Peak
from titanlite.metrics.peak_memory import MemoryMonitor
from titanlite.metrics.runs import Run
from titanlite.metrics.schema import METRICS, RENAMED, StepStats, ValidationResult, tokens_seen_metric
from titanlite.metrics.sinks import Sinks

logger = logging.getLogger("titanlite")


def clock(seconds: float) -> str:
    """`H:MM:SS` for the step line's elapsed time and ETA."""
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


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
    held-out metrics to the TensorBoard layout, `family_metrics` the names of the model family's own
    scalars (`StepStats.family`, on the step line after the data share). `run_label` (`runs.layout_label`)
    and `world_size` describe the run in runs.jsonl and name its TensorBoard folder; `compiled`: the
    first step of the process compiles, so it gives no ETA. `sources`: a mixture's source names, each
    logged as `tokens_seen/<name>` (`StepStats.tokens_seen`).

    The outputs are opened when training starts (`begin`): a start that trains nothing is no run."""

    def __init__(
        self,
        cfg,
        dump_folder: str,
        device: torch.device,
        flops_per_token: float,
        enabled: bool,
        run_config: dict | None = None,
        validation: bool = False,
        stragglers: bool = False,
        family_metrics: tuple[str, ...] = (),
        run_label: str = "1proc",
        world_size: int = 1,
        compiled: bool = False,
        sources: tuple[str, ...] = (),
        replicas: bool = False,
    ):
        self.cfg, self.enabled, self.flops_per_token = cfg, enabled, flops_per_token
        self.dump_folder, self.run_config = dump_folder, run_config
        self.run_label, self.world_size, self.compiled = run_label, world_size, compiled
        self.memory = MemoryMonitor(device)
        self.peak = Peak(cfg.peak_tflops, device) if enabled else None
        shown = [m for m in METRICS if not m.family or m.name in family_metrics]
        self.metrics = [
            m
            for m in shown
            if (device.type == "cuda" or not m.cuda_only)
            and not m.validation
            and (stragglers or not m.straggler)
            and (replicas or not m.replicas)
        ]
        self.metrics += [tokens_seen_metric(name) for name in sources]
        self.val_metrics = [m for m in METRICS if m.validation] if validation else []
        self.sinks: Sinks | None = None
        self.total_steps = 0
        self.start: tuple[float, int] | None = None  # (time, step) of the first log: the ETA's rate
        self.began = time.perf_counter()
        # Colours only for a person at a terminal: log files and pipes get plain text.
        color = not cfg.disable_color_printing and sys.stderr.isatty()
        self.c = {k: (v if color else "") for k, v in COLORS.items()}
        if not enabled:
            return
        peak = f"{self.peak.tflops:.2f} TFLOP/s ({self.peak.source})" if self.peak.tflops else self.peak.source
        logger.info(f"MFU peak: {peak}; memory: {self.memory.kind}")
        if self.peak.tflops is None:
            self.metrics = [m for m in self.metrics if m.name != "mfu_pct"]

    def _open(self, from_step: int) -> Sinks:
        """This run's outputs: metrics.jsonl and runs.jsonl, TensorBoard and W&B when enabled."""
        run = Run(self.run_label, from_step, self.total_steps, self.world_size)
        sinks = self.sinks = Sinks(self.dump_folder, run)
        if self.cfg.enable_tensorboard:
            sinks.open_tensorboard(self.dump_folder, self.cfg.save_tb_folder, self.layout())
        if self.cfg.enable_wandb:
            sinks.open_wandb(self.cfg, self.dump_folder, self.run_config)
        return sinks

    def layout(self) -> dict:
        """The TensorBoard custom-scalars layout: one category per group, one chart per logged metric,
        titled with its display name and unit."""
        groups: dict = {}
        for m in self.metrics + self.val_metrics:
            groups.setdefault(m.group, {})[m.display_name] = ["Multiline", [m.tag]]
        return groups

    def begin(self, step: int, total_steps: int) -> None:
        """Training starts after `step` (0, or the resumed step) and ends at `total_steps`: the run's
        outputs are opened."""
        self.total_steps, self.began = total_steps, time.perf_counter()
        if self.enabled and self.sinks is None:
            self._open(step)

    def _eta(self, step: int, window_step_s: float) -> float | None:
        """Seconds left: the mean step time since the first log (whose window holds the first step, and
        its compilation, so it is left out), or the current window's before there are two logs; None at
        the first log of a compiled run (all it has measured is the compiling step)."""
        now = time.perf_counter()
        first = self.start is None
        if self.start is None:
            self.start = (now, step)
        t0, s0 = self.start
        if step > s0:
            per_step = (now - t0) / (step - s0)
        elif first and self.compiled:
            return None
        else:
            per_step = window_step_s
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
        record.update(s.family)
        record.update({f"tokens_seen/{name}": n for name, n in s.tokens_seen.items()})
        record.update(s.straggler)
        record.update(s.goodput)
        record.update(s.replicas)
        if reserved is not None:
            record["mem_reserved_gib"] = reserved
            record["mem_pct"] = 100.0 * reserved * 2**30 / self.memory.capacity
        self.memory.reset()
        if not self.enabled:
            return record
        sinks = self.sinks or self._open(0)
        c = self.c
        total = self.total_steps or s.step
        elapsed = time.perf_counter() - self.began
        seconds_left = self._eta(s.step, record["step_time_s"])
        eta = "n/a (the first step compiles)" if seconds_left is None else clock(seconds_left)
        family = "".join(f"{name}: {value:.4f}  " for name, value in s.family.items())
        if s.replicas:
            family += f"quorum: {s.replicas['ft/quorum_size']:.0f}  "
        mfu = "n/a" if record["mfu_pct"] is None else format(record["mfu_pct"], ".2f") + "%"
        logger.info(
            f"{c['red']}step {s.step:>{len(str(total))}d}/{total}  {c['green']}loss: {s.loss:8.4f}  "
            f"{c['yellow']}grad_norm: {s.grad_norm:7.4f}  "
            f"{c['cyan']}lr: {s.lr:.3e}  {c['blue']}memory: {mem:5.2f}GiB  "
            f"{c['magenta']}tps: {tps:,.0f}  tflops: {tflops:.3f}  mfu: {mfu}  "
            f"data: {record['data_pct']:.1f}%{c['reset']}  {family}elapsed {clock(elapsed)}  eta {eta}"
        )
        legacy = {old: record[new] for old, new in RENAMED.items()}
        sinks.write(s.step, {**record, **legacy}, self.metrics, record)
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
        sinks = self.sinks or self._open(0)
        c = self.c
        logger.info(
            f"{c['red']}step: {step:5d}  {c['green']}val_loss: {result.loss:8.4f}  val_ppl: {result.perplexity:,.2f}  "
            f"{c['magenta']}({result.tokens:,} held-out tokens in {result.seconds:.2f}s){c['reset']}"
        )
        sinks.write(step, record, self.val_metrics, record)
        return record

    def close(self) -> None:
        if self.sinks is not None:
            self.sinks.close()
            self.sinks = None
