"""The one test harness: launching trainer runs and parity workers, shared tolerances, one tiny model.

* `train(dump, nproc, *overrides, launcher=...)` runs the trainer as users do (`python -m titanlite.train`
  alone, under torchrun, or through `run_train.sh`) and returns its exit code, log and metrics rows.
* `parity(cases, nproc, tmp)` runs many layouts in one launch of `workers/parity.py`, each
  trained by the shipped `Trainer.train_step` and compared with one shared one-process reference;
  `check_parity` applies the tolerances below. A `Case` is the trainer's command-line overrides.
* `tiny_args()` is the tiny Llama every in-process test builds; `one_rank_group()` gives a test the
  one-rank process group a single-process run has.
"""

from __future__ import annotations

import contextlib
import dataclasses
import getpass
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import pytest
import torch.distributed as dist

from titanlite.config import JobConfig, parse_overrides
from titanlite.errors import exit_now
from titanlite.metrics.goodput import BADPUT
from titanlite.models.llama3 import ModelArgs

ROOT = Path(__file__).resolve().parents[1]

# Parity tolerances (fp32, CPU, gloo): loss relative difference over the steps; gradients after step 1
# (they are ~1e-2 to 1e0); parameters after the first AdamW step (AdamW's first step divides by |g|,
# which magnifies rounding on near-zero gradients).
LOSS_REL, GRAD_ABS, PARAM_ABS = 1e-5, 1e-6, 1e-4

# Uneven on purpose: vocab 257 divides by neither 2, 3 nor 4 (the FFN is 192).
TINY = ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=257, multiple_of=32, max_seq_len=64)


def tiny_args(**over) -> ModelArgs:
    """The tiny Llama (3 blocks, dim 64, GQA 4/2, vocab 257, FFN 192), with fields replaced by `over`."""
    return dataclasses.replace(TINY, **over)


# Short, deterministic, every step logged: the base of every trainer run in the tests. Steps, not
# start-up, dominate a debug-model run on 2 cores, so batches are small (2 x 64 tokens per rank).
SMALL = [
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--metrics.log_freq",
    "1",
    "--training.deterministic",
    "--no-metrics.enable_tensorboard",
]

# Two of the debug model's six blocks: for runs that check what surrounds the model (resume, signals,
# checkpoint lineage, data, the launcher) rather than the model itself. On 2 ranks a step and a checkpoint
# cost less than half of the six-block model's (805 vs 347 tokens/s; a save 0.13 vs 0.3 s).
SHALLOW = ["--model.n_layers", "2"]


def threads(nproc: int = 1) -> int:
    """Threads per process for a launch of `nproc` processes: the cores shared by them and by the other
    test processes' launches (`run_tests.sh` runs two test processes, pytest-xdist's workers)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, (os.cpu_count() or 1) // (nproc * workers))


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    # torch's compile cache (importing torch._dynamo creates it) is the one of the test process's temp
    # folder for every launch, as torch's default would make it for that process: a launch given a
    # TMPDIR of its own leaves there only what the launch itself leaves (tests/unit/launcher/test_launcher.py).
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a crashing child (SIGSEGV in a backend) prints its Python stack
    env.update(extra)
    return env


def preflight(*args: str, world: int = 1, timeout: float = 120) -> subprocess.CompletedProcess:
    """The checks run_train.sh runs before it starts any rank (`python -m titanlite.launcher.preflight`), for a
    world of `world` ranks; output captured."""
    cmd = [sys.executable, "-m", "titanlite.launcher.preflight", *args]
    env = child_env(WORLD_SIZE=str(world))
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def rank_pid(dump: Path, rank: int) -> int | None:
    """The pid of rank `rank` of the run training into `dump` (its RANK in /proc/<pid>/environ), for faults
    injected from outside the ranks as a scheduler or an operator would."""
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0") if entry.name.isdigit() else []
            if str(dump).encode() in argv and b"titanlite.train" in argv:
                if f"RANK={rank}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                    return int(entry.name)
        except OSError:
            continue
    return None


def torchrun(
    args: list[str], nproc: int, timeout: float = 600, env: dict | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """Run `python -m torch.distributed.run --standalone --nproc_per_node N <args>`; output captured."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    return subprocess.run(cmd, env=env or child_env(), cwd=cwd or ROOT, capture_output=True, text=True, timeout=timeout)


def start_launch(
    args: list[str], env: dict[str, str], stdout=subprocess.PIPE, stderr=subprocess.PIPE
) -> subprocess.Popen:
    """`run_train.sh args` from the repository root, in a session of its own (its process group is the
    launch's, as a job's is); text output to `stdout` and `stderr` (pipes unless given)."""
    return subprocess.Popen(
        [str(ROOT / "run_train.sh"), *args],
        env=env,
        cwd=ROOT,
        stdout=stdout,
        stderr=stderr,
        text=True,
        start_new_session=True,
    )


def launch_workers(
    script: str, args: list[str], nproc: int, timeout: float = 600, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run the test worker `script` on `nproc` ranks with torchrun's environment, forked from one process
    that has imported torch and the trainer (`workers/ranks.py`); output captured."""
    cmd = [sys.executable, str(ROOT / "tests" / "workers" / "ranks.py"), str(nproc), script, *args]
    return subprocess.run(cmd, env=env or child_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-6000:]
        pytest.fail(f"exit code {proc.returncode}\n{tail}")


@dataclass
class RunResult:
    returncode: int
    stdout: str
    stderr: str
    dump: Path

    @property
    def log(self) -> str:
        return self.stdout + self.stderr

    @property
    def metrics(self) -> list[dict]:
        path = self.dump / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.metrics if "loss" in r]  # validation rows have `val_loss` instead

    def ok(self) -> RunResult:
        if self.returncode != 0:
            pytest.fail(f"exit code {self.returncode}\n{self.log[-6000:]}")
        return self


def train(
    dump: Path,
    nproc: int,
    *overrides: str,
    config: str = "train_configs/debug_model.toml",
    launcher: str = "auto",
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> RunResult:
    """Train with `config` + `overrides` into `dump`. `launcher`: `python` (one process, no torchrun),
    `torchrun`, `run_train` (the launcher script, NGPU=nproc), or `auto` (python for 1, else torchrun)."""
    args = ["--config", config, "--job.dump_folder", str(dump), *overrides]
    given = env or {}
    env = child_env(**given)
    if launcher == "auto":
        launcher = "python" if nproc == 1 else "torchrun"
    if "OMP_NUM_THREADS" not in given:
        # As run_train.sh does for users: the cores shared by the ranks (and by the other test process's).
        env["OMP_NUM_THREADS"] = str(threads(nproc))
    if launcher == "python":
        proc = subprocess.run(
            [sys.executable, "-m", "titanlite.train", *args],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    elif launcher == "torchrun":
        proc = torchrun(["-m", "titanlite.train", *args], nproc, timeout=timeout, env=env)
    else:
        env["NGPU"] = str(nproc)
        proc = subprocess.run(
            [str(ROOT / "run_train.sh"), *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )
    return RunResult(proc.returncode, proc.stdout, proc.stderr, dump)


GOODPUT_LINE = re.compile(
    r"goodput (?P<pct>\d+\.\d)% of (?P<wall>\d+) s: "
    + ", ".join(rf"{c.name} (?P<{c.name}>\d+\.\d) s" for c in BADPUT)
    + r" \(ledger (?P<ledger>\S+)(?P<unwritten> not written: .*)?\)"
)
"""The line the launcher ends a launch with (titanlite/metrics/goodput.py, `Totals.line`)."""


def launcher_lines(stderr: str) -> list[str]:
    """What the launcher itself printed (not the ranks' `[rankN]:` lines), less the goodput line it ends a
    launch with (`GOODPUT_LINE`; the tests of goodput read it)."""
    return [line for line in stderr.splitlines() if not line.startswith("[rank") and not GOODPUT_LINE.fullmatch(line)]


def train_in_one_launch(
    runs: list[tuple[Path, list[str]]],
    nproc: int,
    config: str = "train_configs/debug_model.toml",
    copy_before: dict[Path, Path] | None = None,
) -> dict[Path, RunResult]:
    """Train each (dump, overrides) of `runs` with `config`, one after another in one launch of
    `workers/runs.py` (`launch_workers`; each run is `titanlite.train.main`, as `train(...,
    launcher="torchrun")` runs it);
    every run must succeed. `copy_before` maps a run's dump folder to a checkpoint step folder of an
    earlier run of the launch, copied there just before the run (which resumes from it). Each result's
    `stderr` holds every rank's output of that run."""
    specs = []
    for dump, overrides in runs:
        spec: dict = {"dump": str(dump), "argv": ["--config", config, "--job.dump_folder", str(dump), *overrides]}
        if copy_before and dump in copy_before:
            src = copy_before[dump]
            spec["copy"] = [str(src), str(dump / "checkpoint" / src.name)]
        specs.append(spec)
    spec_file = runs[0][0].parent / f"runs-{runs[0][0].name}.json"
    spec_file.write_text(json.dumps(specs))
    env = child_env(OMP_NUM_THREADS=str(threads(nproc)))
    assert_ok(launch_workers("tests/workers/runs.py", [str(spec_file)], nproc, env=env))
    logs = {dump: "".join(p.read_text() for p in sorted(dump.glob("worker.rank*.log"))) for dump, _ in runs}
    return {dump: RunResult(0, "", logs[dump], dump) for dump, _ in runs}


def end_worker() -> None:
    """End a test worker once its results are written: the ranks wait for each other, the
    process group goes and the process exits as the trainer's ranks do (`errors.exit_now`)."""
    dist.barrier()
    dist.destroy_process_group()
    exit_now(0)


def step_metric(dump: Path, key: str = "loss") -> dict[int, float]:
    """Step -> `key` of each row of a run's metrics.jsonl that has it (training or validation rows)."""
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if key in r}


def max_rel(a: dict[int, float], b: dict[int, float]) -> float:
    """The largest relative difference of `a` from `b` over `a`'s steps, every one of which `b` has."""
    assert a and set(a) <= set(b), (a, b)
    return max(abs(a[s] - b[s]) / abs(b[s]) for s in a)


def copy_checkpoint(src: Path, dst: Path, step: int) -> Path:
    """`src`'s step-`step` checkpoint alone in a fresh dump folder `dst` (returned): a run there resumes
    from it."""
    ckpt = Path("checkpoint") / f"step-{step}"
    shutil.copytree(src / ckpt, dst / ckpt)
    return dst


def assert_resumed(result: RunResult, step: int) -> None:
    """The run resumed from its step-`step` checkpoint (the trainer's start-up line)."""
    assert f"step-{step} at step {step}" in result.stderr, result.stderr[-3000:]


def resume_from(src: Path, dst: Path, step: int, run: Callable[[Path], RunResult]) -> RunResult:
    """Copy `src`'s step-`step` checkpoint alone into a fresh dump folder `dst`, run there, and check
    that the run resumed from it."""
    result = run(copy_checkpoint(src, dst, step))
    assert_ok(result)
    assert_resumed(result, step)
    return result


@dataclass(frozen=True)
class Case:
    """One layout of `parity`: the trainer's overrides as a user passes them to run_train.sh (`--section.key
    value`, `--section.flag`), over the worker's base config (`workers/parity.py`). The other fields are the
    test's alone: the tiny model's depth and Qwen3's tied embedding (the worker builds the model args), a
    negative control's sabotage (`same_data`: every rank trains on the first rank's slice; `no_kv_grad`: the
    K/V gather without its backward reduce-scatter), and `apart`: held by a test of its own rather than
    by the harness's tolerances."""

    overrides: str = ""
    layers: int = TINY.n_layers
    tied: bool = True
    control: Literal["", "same_data", "no_kv_grad"] = ""
    apart: bool = False

    def settings(self) -> dict[str, Any]:
        """The overrides as `{section.key: value}` (a flag True or False, the rest as written), by the config's
        own command-line parser; a key given twice keeps its last value, as on the command line."""
        return dict(parse_overrides(shlex.split(self.overrides)))

    def sections(self) -> dict[str, dict[str, Any]]:
        """The overrides as `{section: {key: value}}`, the form `titanlite.config.apply_dict` applies."""
        out: dict[str, dict[str, Any]] = {}
        for key, value in self.settings().items():
            section, _, name = key.partition(".")
            out.setdefault(section, {})[name] = value
        return out


def as_case(case: Case | str | dict) -> Case:
    """A case from its overrides alone, or from its record's JSON form."""
    return Case(case) if isinstance(case, str) else Case(**case) if isinstance(case, dict) else case


def case_id(case: Case | str | dict) -> str:
    """The case's test id: each override as `key=value` (a flag as `key`, `no-key` when off), its section
    left out where no other section has a key of that name, then the run's own test fields that differ from
    their defaults (`apart` says how a case is judged, not what runs)."""
    case = as_case(case)
    names = [name for body in JobConfig().to_dict().values() for name in body]
    words = []
    for key, value in case.settings().items():
        name = key.partition(".")[2]
        word = name if names.count(name) == 1 else key
        words.append(word if value is True else f"no-{word}" if value is False else f"{word}={value}")
    default = Case()
    for field in ("layers", "tied", "control"):
        value = getattr(case, field)
        if value != getattr(default, field):
            words.append(field if value is True else f"no-{field}" if value is False else f"{field}={value}")
    return "-".join(words)


def parity(cases: list[Case | str], nproc: int, tmp_path: Path, env: dict[str, str] | None = None) -> list[dict]:
    """One launch of the parity worker over `cases`; one record per case (workers/parity.py), its `case`
    the `Case` and its `config` the run's resolved config (as `JobConfig.to_dict`)."""
    out = tmp_path / "parity.json"
    specs = json.dumps([dataclasses.asdict(as_case(c)) for c in cases])
    assert_ok(launch_workers("tests/workers/parity.py", [specs, str(out)], nproc, env=child_env(**(env or {}))))
    records = json.loads(out.read_text())
    assert len(records) == len(cases)
    for rec in records:
        rec["case"] = as_case(rec["case"])
    return records


def check_parity(records: list[dict]) -> None:
    bad = [
        r
        for r in records
        if not (r["loss_rel"] <= LOSS_REL and r["grad_abs"] <= GRAD_ABS and r["param_abs"] <= PARAM_ABS)
        or r.get("missing")
    ]
    assert not bad, "\n".join(
        f"{r['case']}: loss_rel={r['loss_rel']:.2e} grad={r['grad_abs']:.2e} param={r['param_abs']:.2e}"
        f"{' missing ' + ', '.join(r['missing']) if r.get('missing') else ''}"
        for r in bad
    )


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """The one-rank gloo process group a single-process run has (titanlite.run.build.init_distributed)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()
