"""One-GPU smoke test of the user's path: `NGPU=1 ./run_train.sh` trains the 1B config in bf16 with compiled,
bucketed blocks and async checkpoints, a second launch resumes from the middle checkpoint, and one table
says whether it all worked.

    scripts/gpu_smoke.sh [--steps 20] [--json FILE] [--dump DIR] [--config FILE] [--section.key value ...]

What runs, in order, within `--time-limit` (7.5 minutes: each launch's timeout shrinks to what is left;
on one H200 it all took 184 s):

1. The environment: torch, CUDA, the device and whether it supports bf16; the dry run of the same config
   for a world of one (`titanlite.tools.dry_run.dry_run`, what `./run_train.sh --dry-run` runs), which
   also validates the config before anything is launched; and one causal bf16 `scaled_dot_product_attention`
   with the model's head count, kv heads and head dim (GQA) under `sdpa_kernel(FLASH_ATTENTION)`, forward
   and backward, against a float32 reference. Without it the trainer's attention silently falls back to
   a slower kernel, so a GPU that cannot run it fails the smoke test.
2. `NGPU=1 ./run_train.sh --config <config> --training.steps N` into `<dump>/run`, checkpointing every
   N/2 steps with async saves and logging every step to metrics.jsonl (the last save keeps only the
   bf16 weights: a full 1B checkpoint is 12 GB, and only the middle one is resumed).
3. The same command into `<dump>/resume`, a fresh dump folder holding only the step-N/2 checkpoint
   (hard links), with `--checkpoint.load_step N/2`: it must resume there (its metrics start at step
   N/2 + 1) and log the losses of the uninterrupted run.
4. The verdict, from the runs' metrics.jsonl and compile_report.json (never from log text): tokens/s per
   GPU and MFU (medians over the steps after `--warmup`), peak memory against the dry run's estimate,
   compile seconds, resume and flash attention; printed as one table and written as JSON (`--json`,
   default `<dump>/gpu_smoke.json`). Exit code 0 only if every check passed, 1 otherwise, 2 for a bad
   config (one line, before anything runs).

Resume tolerance: on CPU the resumed losses must be bitwise equal (one process on CPU is deterministic,
and the checkpoint restores parameters, AdamW state, schedule, RNG and data position exactly). On a GPU
they must agree within 1e-3 relative: the first resumed step starts from bitwise the same state, but
backward kernels that accumulate with atomics (flash attention's dq) are not bitwise reproducible
without `training.deterministic`, and bf16 rounding carries such differences into later losses; resume
faults (a wrong data position, a lost optimizer state) move the loss by far more than that after one step.
Memory: the measured peak (CUDA max allocated) may exceed the estimate by at most 10%; under the estimate
is fine, since the estimate is an upper bound for compiled blocks.

Without CUDA the same steps run on CPU in seconds (debug flavor, 2 x 64 tokens, aot_eager, 4 steps with a
checkpoint at step 2) so the script cannot rot where there is no GPU; its numbers say nothing about GPUs.
Flash attention is then "n/a (cpu)", and the memory comparison too: the CPU peak is the process's
resident set, which holds the Python runtime as well.

Run folders `<dump>/run` and `<dump>/resume` are deleted at the start. After a passing smoke test their
checkpoints are deleted too (`--keep-checkpoints` keeps them); after a failing one they stay for a look.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from titanlite.compile.report import REPORT_NAME
from titanlite.config import load_config
from titanlite.errors import ConfigError, run_cli
from titanlite.metrics import peak_tflops
from titanlite.planning.memory import GiB
from titanlite.tools.dry_run import dry_run, format_report

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "train_configs/llama3_1b_gpu.toml"
"""Relative to the checkout (like any relative --config that does not exist from the current folder)."""
CPU_FORM = [
    "--model.flavor",
    "debugmodel",
    "--training.local_batch_size",
    "2",
    "--training.seq_len",
    "64",
    "--compile.backend",
    "aot_eager",
]
GPU_STEPS, CPU_STEPS = 20, 4
GPU_RESUME_RTOL, CPU_RESUME_RTOL = 1e-3, 0.0
MEMORY_SLACK = 0.10
"""The measured peak may exceed the dry run's estimate by this fraction."""
FLASH_ATOL = 5e-2
"""bf16 flash attention against a float32 reference on N(0, 1) inputs: bf16 rounding alone gives ~1e-2."""
STOP_GRACE_S = 30
"""After a launch's timeout: SIGTERM (its rank saves and stops at the next step), SIGKILL this much later."""
TIME_LIMIT_S = 450
"""The whole smoke test, launches and their stops included: 7.5 minutes (`--time-limit`)."""
RUN_SHARE = 0.6
"""Of the time left after the dry run, what the uninterrupted run may take at most (the resume gets the rest)."""


@dataclass
class Run:
    """One `run_train.sh` launch: its exit code, wall time and training rows of metrics.jsonl."""

    name: str
    dump: str
    command: list[str]
    returncode: int | None = None
    wall_s: float = 0.0
    timed_out: bool = False
    rows: list[dict[str, Any]] = field(default_factory=list)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="scripts/gpu_smoke.sh",
        description=__doc__.split("\n\n")[0],
        epilog="Other arguments (--section.key value) go to both runs and the dry run; they override the smoke "
        "test's own settings.",
    )
    parser.add_argument("--config", default=CONFIG, help=f"training config (default {CONFIG})")
    parser.add_argument(
        "--steps", type=int, help=f"steps of the uninterrupted run (default {GPU_STEPS}, CPU {CPU_STEPS})"
    )
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of tokens/s and MFU (compilation)")
    parser.add_argument("--dump", help="folder for the runs and the report (default ./outputs/gpu_smoke)")
    parser.add_argument("--json", help="write the verdict here (default <dump>/gpu_smoke.json)")
    parser.add_argument("--resume-rtol", type=float, help="relative loss tolerance of the resumed steps")
    parser.add_argument("--run-timeout", type=float, default=240, help="seconds per run_train.sh launch at most")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=TIME_LIMIT_S,
        help=f"seconds for the whole test (default {TIME_LIMIT_S}): the launches' timeouts shrink to fit",
    )
    parser.add_argument("--keep-checkpoints", action="store_true", help="keep the runs' checkpoints after a pass")
    parser.add_argument("--quiet", action="store_true", help="runs' output only to <dump>/<run>.log")
    args, overrides = parser.parse_known_args(argv)
    if args.steps is not None and args.steps < 2:
        parser.error("--steps must be at least 2 (a checkpoint at steps / 2, then a resume)")
    return args, overrides


# --- the environment ---------------------------------------------------------------------------------------


def environment(device: torch.device) -> dict[str, Any]:
    """What the device and torch are; `bf16` is None on CPU (the CPU form runs bf16 compute regardless)."""
    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": "cpu"}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            device=props.name,
            capability=f"sm_{props.major}{props.minor}",
            memory_gib=props.total_memory / GiB,
            bf16=torch.cuda.is_bf16_supported(),
        )
    else:
        env.update(capability=None, memory_gib=None, bf16=None)
    return env


def flash_check(
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    device: torch.device,
    backend: SDPBackend = SDPBackend.FLASH_ATTENTION,
    seq_len: int = 256,
) -> tuple[bool, str]:
    """Whether `backend` runs the model's attention (causal, bf16, GQA as the model calls it) forward and
    backward and agrees with a float32 reference; (ok, one line saying what happened)."""
    g = torch.Generator(device=device).manual_seed(0)

    def rand(heads: int) -> torch.Tensor:
        x = torch.randn(2, heads, seq_len, head_dim, generator=g, device=device)
        return x.to(torch.bfloat16).requires_grad_()

    q, k, v = rand(n_heads), rand(n_kv_heads), rand(n_kv_heads)
    gqa = n_kv_heads != n_heads
    what = f"{backend.name.lower()}, bf16, {n_heads}/{n_kv_heads} heads, head dim {head_dim}"
    # torch says why it rejects a backend in warnings, then raises a generic "no viable backend" error.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
                out.float().sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except RuntimeError as e:
            reasons = [str(w.message).splitlines()[0] for w in caught] or [str(e).splitlines()[0]]
            return False, f"failed ({what}): {reasons[0]}"
    ref = F.scaled_dot_product_attention(
        q.detach().float(), k.detach().float(), v.detach().float(), is_causal=True, enable_gqa=gqa
    )
    err = (out.detach().float() - ref).abs().max().item()
    finite = all(t.grad is not None and bool(t.grad.isfinite().all()) for t in (q, k, v))
    if not finite or not err <= FLASH_ATOL:
        return False, f"wrong results ({what}): max abs error {err:.3g} vs float32, finite gradients {finite}"
    del q, k, v, out, ref
    if device.type == "cuda":
        torch.cuda.empty_cache()  # this process stays alive beside the runs: hand the blocks back
    return True, f"ok ({what}; max abs error {err:.1e} vs float32)"


# --- the runs -------------------------------------------------------------------------------------------------


def launch(run: Run, timeout: float, log_path: Path, echo: bool) -> Run:
    """Run `run.command` (a run_train.sh launch) with NGPU=1; its output goes to `log_path` (and stdout).

    Past `timeout` the launcher gets SIGTERM, which stops its rank at the next step, and SIGKILL after
    STOP_GRACE_S more (its rank dies with it)."""
    env = dict(os.environ, NGPU="1")
    env.setdefault("PYTHON", sys.executable)  # run_train.sh then uses this Python instead of setting one up
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            run.command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        reader = threading.Thread(target=_copy_lines, args=(proc.stdout, log, echo), daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            run.timed_out = True
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reader.join(timeout=10)
    run.returncode, run.wall_s = proc.returncode, time.perf_counter() - start
    run.rows = training_rows(Path(run.dump))
    return run


def _copy_lines(stream: TextIO, log: TextIO, echo: bool) -> None:
    for line in stream:
        log.write(line)
        log.flush()
        if echo:
            sys.stdout.write(line)
            sys.stdout.flush()


def training_rows(dump: Path) -> list[dict[str, Any]]:
    """The step rows of `<dump>/metrics.jsonl` (validation rows have no `loss`)."""
    path = dump / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "loss" in r]


def link_checkpoint(src: Path, dst: Path) -> None:
    """A complete checkpoint folder in a fresh dump folder, as hard links (a 1B checkpoint is 12 GB; its
    files are never written again once complete), copied where links are not possible."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        shutil.copytree(src, dst, copy_function=os.link)
    except OSError:
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)


def resolve_config(path: str) -> str:
    """A config path as given (relative to the current folder), else relative to the checkout, as the default
    is; a path that is neither is left to the config loader, which reports it in one line."""
    for base in (Path.cwd(), ROOT):
        if (base / path).is_file():
            return str((base / path).resolve())
    return path


def mfu_peak(configured: float, device: torch.device) -> str:
    """What the runs' MFU is relative to, as the trainer chooses it (`titanlite.metrics.peak_tflops`). The CPU
    peak is not asked for here: it is cached per thread count, and this process is not the rank."""
    if configured:
        return f"of {configured:g} TFLOP/s (metrics.peak_tflops)"
    if device.type != "cuda":
        return "of this CPU's fp32 matmul peak, measured once and cached"
    peak, source = peak_tflops(device)
    return f"of {peak:g} TFLOP/s ({source})" if peak else f"n/a: {source}; set --metrics.peak_tflops"


def strict_json(x: Any) -> Any:
    """`x` with non-finite floats as strings: a NaN loss must not make the report unreadable to strict parsers."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: strict_json(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [strict_json(v) for v in x]
    return x


# --- the verdict ----------------------------------------------------------------------------------------------


def _span(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else (str(steps[0]) if steps else "none")


def rel_diff(a: float, b: float) -> float:
    """|a - b| / |a|; 0 for equal values, inf where either is not finite."""
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), 1e-30)


def compare_resume(
    uninterrupted: list[dict], resumed: list[dict], resume_step: int, steps: int, rtol: float
) -> dict[str, Any]:
    """The resumed run must log exactly steps resume_step+1..steps, with the uninterrupted run's losses
    (within `rtol` relative; 0 = bitwise). A run that did not resume starts at step 1 and fails here."""
    want = list(range(resume_step + 1, steps + 1))
    a = {r["step"]: r["loss"] for r in uninterrupted}
    b = {r["step"]: r["loss"] for r in resumed}
    result: dict[str, Any] = {"ok": False, "rtol": rtol, "steps": _span(want), "max_rel_diff": None, "bitwise": False}
    if sorted(b) != want:
        result["why"] = f"the resumed run logged steps {_span(sorted(b))}, expected {_span(want)}"
        return result
    if missing := [s for s in want if s not in a]:
        result["why"] = f"the uninterrupted run has no loss for steps {_span(missing)}"
        return result
    diffs = [rel_diff(a[s], b[s]) for s in want]
    worst = max(diffs)
    result.update(max_rel_diff=worst, bitwise=all(a[s] == b[s] for s in want), ok=worst <= rtol)
    if not result["ok"]:
        step = want[diffs.index(worst)]
        result["why"] = (
            f"step {step}: loss {b[step]!r} resumed vs {a[step]!r} uninterrupted (rel {worst:.2e} > {rtol:g})"
        )
    return result


def throughput(rows: list[dict], warmup: int) -> dict[str, Any]:
    """Medians over the steps after `warmup` (compilation; the median also ignores the step that staged an
    async checkpoint), and the first step's time, which includes compilation."""
    timed = [r for r in rows if r["step"] > warmup]
    mfu = [r["mfu_pct"] for r in timed if r.get("mfu_pct") is not None]
    return {
        "tokens_per_s": statistics.median(r["tps"] for r in timed) if timed else None,
        "mfu_pct": statistics.median(mfu) if mfu else None,
        "timed_steps": _span([r["step"] for r in timed]),
        "peak_gib": max((r["mem_peak_gib"] for r in rows), default=None),
        "first_step_s": next((r["step_time_s"] for r in rows if r["step"] == 1), None),
    }


def checks(r: dict[str, Any]) -> dict[str, bool | None]:
    """Each check's outcome: True passed, False failed, None not applicable (CPU form)."""
    run, on_gpu = r["runs"]["run"], r["form"] == "gpu"
    rows_ok = (
        run["returncode"] == 0 and not run["timed_out"] and run["steps_logged"] == r["steps"] and run["losses_finite"]
    )
    tps = r["tokens_per_s"]
    memory: bool | None = None
    if on_gpu and r["peak_gib"] is not None and r["estimate_gib"]:
        memory = r["peak_gib"] <= r["estimate_gib"] * (1 + MEMORY_SLACK)
    elif on_gpu:
        memory = False
    return {
        "bf16": r["environment"]["bf16"] if on_gpu else None,
        "flash_attention": r["flash_attention"]["ok"],
        "training": rows_ok,
        "throughput": tps is not None and math.isfinite(tps) and tps > 0,
        "memory": memory,
        "compile": r["compile_seconds"] is not None,
        "resume": r["resume"]["ok"],
    }


def passed(c: dict[str, bool | None]) -> bool:
    return all(v is not False for v in c.values())


def _mark(ok: bool | None) -> str:
    return "n/a" if ok is None else ("ok" if ok else "FAILED")


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(r: dict[str, Any]) -> str:
    """The verdict as one table: what was measured and whether each check passed."""
    c, env, res = r["checks"], r["environment"], r["resume"]
    on_gpu = r["form"] == "gpu"
    device = (
        f"{env['device']} ({env['capability']}, {env['memory_gib']:.0f} GiB), torch {env['torch']}, CUDA {env['cuda']}"
        if on_gpu
        else f"cpu, torch {env['torch']} (CPU form: numbers say nothing about GPUs)"
    )
    run = r["runs"]["run"]
    if res.get("max_rel_diff") is None:
        resume = res.get("why", "not run")
    else:
        how = "bitwise equal" if res["bitwise"] else f"max rel diff {res['max_rel_diff']:.1e}"
        resume = f"steps {res['steps']} {how} (tolerance {'bitwise' if res['rtol'] == 0 else format(res['rtol'], 'g')})"
        if res.get("why"):
            resume += f"; {res['why']}"
    if r["peak_gib"] is None:
        memory = "-"
    else:
        memory = f"{r['peak_gib']:.2f} GiB {r['memory_kind']} vs {_num(r['estimate_gib'], '.2f')} GiB estimated"
        if on_gpu and r["estimate_gib"]:
            memory += f" (x{r['peak_gib'] / r['estimate_gib']:.2f}, limit x{1 + MEMORY_SLACK:.2f})"
        elif not on_gpu:
            memory += " (RSS holds the runtime too)"
    rows = [
        ("device", device, _mark(c["bf16"]) if on_gpu else ""),
        ("flash attention", r["flash_attention"]["detail"], _mark(c["flash_attention"])),
        (
            "training (run_train.sh)",
            f"{r['config_name']} {r['flavor']}, {run['steps_logged']}/{r['steps']} steps, "
            f"{'stopped at --run-timeout' if run['timed_out'] else 'exit ' + str(run['returncode'])}, "
            f"{run['wall_s']:.0f} s",
            _mark(c["training"]),
        ),
        (
            "tokens/s per GPU",
            f"{_num(r['tokens_per_s'], ',.0f')} (median of steps {r['timed_steps']})"
            if r["tokens_per_s"] is not None
            else f"- (no step after the {r['warmup']} warm-up steps)",
            _mark(c["throughput"]),
        ),
        (
            "MFU",
            f"{_num(r['mfu_pct'], '.1f')}% {r['peak_source']}" if r["mfu_pct"] is not None else r["peak_source"],
            "",
        ),
        ("peak memory vs dry run", memory, _mark(c["memory"])),
        (
            "compile",
            f"{_num(r['compile_seconds'], '.1f')} s in the backends (compile_report.json); "
            f"step 1 took {_num(r['first_step_s'], '.1f')} s",
            _mark(c["compile"]),
        ),
        (f"resume from step {r['resume_step']}", resume, _mark(c["resume"])),
    ]
    w0, w1 = max(len(a) for a, _, _ in rows), max(len(b) for _, b, _ in rows)
    lines = [
        f"{'check':<{w0}}  {'measured':<{w1}}  verdict",
        *(f"{a:<{w0}}  {b:<{w1}}  {v}".rstrip() for a, b, v in rows),
    ]
    lines.append(f"verdict: {'PASS' if r['passed'] else 'FAIL'} ({r['wall_s']:.0f} s)")
    return "\n".join(lines)


# --- the smoke test ------------------------------------------------------------------------------------------


def smoke(argv: list[str]) -> dict[str, Any]:
    started = time.perf_counter()
    args, overrides = parse_args(argv)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    on_gpu = device.type == "cuda"
    steps = args.steps or (GPU_STEPS if on_gpu else CPU_STEPS)
    resume_step = steps // 2
    rtol = args.resume_rtol if args.resume_rtol is not None else (GPU_RESUME_RTOL if on_gpu else CPU_RESUME_RTOL)
    dump = Path(args.dump or ROOT / "outputs" / "gpu_smoke").resolve()
    form = [] if on_gpu else CPU_FORM
    config = resolve_config(args.config)
    settings = [
        *form,
        "--training.mixed_precision_param",
        "bfloat16",
        "--compile.enable",
        "--compile.bucketing",
        "transformer_block",
        "--training.steps",
        str(steps),
        "--checkpoint.enable",
        "--checkpoint.interval",
        str(resume_step),
        "--checkpoint.async_mode",
        "async",
        "--checkpoint.last_save_model_only",
        "--checkpoint.export_dtype",
        "bfloat16",
        "--metrics.log_freq",
        "1",
        "--no-metrics.enable_tensorboard",
        *overrides,
    ]
    env = environment(device)
    say = (lambda *a: None) if args.quiet else (lambda *a: print("gpu_smoke:", *a, flush=True))
    say(
        f"torch {env['torch']}, "
        + (f"{env['device']} ({env['capability']}), bf16 {env['bf16']}" if on_gpu else "no CUDA: the CPU form")
    )

    # The dry run first: it validates the config (one line, exit code 2) before anything is launched.
    memory_gib = ["--comm.fake_gpu_memory_gib", f"{env['memory_gib']:.1f}"] if on_gpu else []
    planned = dry_run(load_config(["--config", config, *settings, "--comm.fake_world_size", "1", *memory_gib]))
    say("dry run, world size 1:\n" + format_report(planned))
    margs = planned.plan.model_args
    # The steps and the resume point as the runs will see them (an override may have changed either).
    steps, resume_step = planned.cfg.training.steps, planned.cfg.checkpoint.interval
    if not resume_step < steps:
        raise ConfigError(f"checkpoint.interval {resume_step} must be below training.steps {steps} to test a resume")
    if on_gpu:
        ok, detail = flash_check(margs.n_heads, margs.kv_heads, margs.head_dim, device)
    else:
        ok, detail = None, "n/a (cpu)"
    say(f"flash attention: {detail}")

    for name in ("run", "resume"):
        shutil.rmtree(dump / name, ignore_errors=True)
    dump.mkdir(parents=True, exist_ok=True)

    def command(name: str, *extra: str) -> list[str]:
        return [
            str(ROOT / "run_train.sh"),
            "--config",
            config,
            *settings,
            "--job.dump_folder",
            str(dump / name),
            *extra,
        ]

    run = Run("run", str(dump / "run"), command("run"))
    say(f"uninterrupted run, steps 1-{steps}: NGPU=1 {' '.join(run.command)}")

    def left() -> float:
        return args.time_limit - (time.perf_counter() - started) - STOP_GRACE_S

    launch(run, max(1.0, min(args.run_timeout, RUN_SHARE * left())), dump / "run.log", not args.quiet)
    resumed = Run("resume", str(dump / "resume"), command("resume", "--checkpoint.load_step", str(resume_step)))
    middle = dump / "run" / "checkpoint" / f"step-{resume_step}"
    if run.returncode == 0 and middle.is_dir():
        link_checkpoint(middle, dump / "resume" / "checkpoint" / middle.name)
        say(f"resumed run from {middle.name}, steps {resume_step + 1}-{steps}: NGPU=1 {' '.join(resumed.command)}")
        launch(resumed, max(1.0, min(args.run_timeout, left())), dump / "resume.log", not args.quiet)
        resume = compare_resume(run.rows, resumed.rows, resume_step, steps, rtol)
        if resumed.returncode != 0 or resumed.timed_out:
            stopped = "was stopped at --run-timeout" if resumed.timed_out else f"exited with code {resumed.returncode}"
            resume.update(ok=False, why=f"the resumed run {stopped}")
    else:
        why = "the uninterrupted run failed" if run.returncode != 0 or run.timed_out else f"no checkpoint {middle}"
        resume = {"ok": False, "rtol": rtol, "max_rel_diff": None, "why": f"not run: {why}"}

    report_path = dump / "run" / REPORT_NAME
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    result: dict[str, Any] = {
        "form": "gpu" if on_gpu else "cpu",
        "environment": env,
        "flash_attention": {"ok": ok, "detail": detail},
        "config": config,
        "config_name": Path(config).name,
        "flavor": planned.cfg.model.flavor,
        "params": margs.num_params(),
        "local_batch": planned.cfg.training.local_batch_size,
        "seq_len": planned.cfg.training.seq_len,
        "overrides": overrides,
        "steps": steps,
        "resume_step": resume_step,
        "warmup": args.warmup,
        **throughput(run.rows, args.warmup),
        "memory_kind": "cuda max allocated" if on_gpu else "cpu peak RSS",
        "peak_source": mfu_peak(planned.cfg.metrics.peak_tflops, device),
        "estimate_gib": planned.memory.total / GiB,
        "estimate_activations_gib": planned.memory.activations / GiB,
        "compile_seconds": report.get("compile_seconds"),
        "resume": resume,
        "runs": {
            r.name: {
                "returncode": r.returncode,
                "wall_s": r.wall_s,
                "timed_out": r.timed_out,
                "steps_logged": len(r.rows),
                "losses_finite": bool(r.rows) and all(math.isfinite(x["loss"]) for x in r.rows),
                "command": r.command,
            }
            for r in (run, resumed)
        },
        "dump": str(dump),
    }
    result["checks"] = checks(result)
    result["passed"] = passed(result["checks"])
    if result["passed"] and not args.keep_checkpoints:
        for name in ("run", "resume"):
            shutil.rmtree(dump / name / "checkpoint", ignore_errors=True)
    result["wall_s"] = time.perf_counter() - started
    result["json"] = str(Path(args.json).resolve() if args.json else dump / "gpu_smoke.json")
    return result


def main(argv: list[str]) -> int:
    result = smoke(argv)
    print(table(result), flush=True)
    path = Path(result["json"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(strict_json(result), indent=2) + "\n")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(run_cli(main))
