"""run_train.sh and its launcher (titanlite/launcher/launch.py) as a scheduler and a terminal use them.

Each case starts `run_train.sh` in a session of its own (as a job is), waits for the first logged step,
signals the launcher or its whole process group the way SLURM, Kubernetes or a terminal do, and checks
the exit code, what the user sees on stderr besides the ranks' own log (`[rankN]:` lines), the
checkpoint folder, and that no rank process outlives the run. Failures inside ranks come from the
test-only `TITANLITE_FAULT_*` variables (titanlite/faults.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from harness import GOODPUT_LINE, ROOT, SHALLOW, SMALL, child_env, launcher_lines, start_launch
from titanlite.launcher.agent import root_cause
from titanlite.run.rank_exit import write_failure

# Long enough to be running when signalled; checkpoints only when stopped.
RUN = [*SMALL, *SHALLOW, "--training.steps", "1000"]
CHECKPOINTING = ["--checkpoint.enable", "--checkpoint.interval", "1000"]
NOTHING_TRAINED = "stop signal ({}) before the first step: nothing trained, nothing to save; exiting"


@dataclass
class Case:
    name: str
    signals: list[tuple[str, signal.Signals]] = field(default_factory=list)  # ("group" | "launcher", signal)
    env: dict[str, str] = field(default_factory=dict)
    code: int = 0
    lines: list[str] = field(default_factory=list)  # the launcher's own stderr lines (prefixes)
    saved: bool = False  # a complete checkpoint of the step the ranks stopped at
    traceback: bool = False
    nproc: int = 2  # one rank where a second adds nothing to what the case checks
    when: str = "first step"  # when the signals are sent: "first step" logged, "launcher" (its handler is
    # installed, no rank yet: it is importing torch) or "ranks" (the rank processes exist: they are importing)
    rank_line: str = ""  # a line rank 0 must log
    goodput: bool = True  # the launch ends with the goodput line (ranks started; no bad input, no SIGKILL)
    args: list[str] = field(default_factory=lambda: CHECKPOINTING)


CASES = [
    Case("sigterm-to-group", [("group", signal.SIGTERM)], saved=True),
    Case("sigterm-to-launcher", [("launcher", signal.SIGTERM)], saved=True),
    Case("sigusr1-to-launcher", [("launcher", signal.SIGUSR1)], saved=True, nproc=1),
    Case("ctrl-c", [("group", signal.SIGINT)], saved=True, nproc=1),
    Case(
        "ctrl-c-twice",
        [("group", signal.SIGINT), ("group", signal.SIGINT)],
        code=130,
        lines=["titanlite: interrupted twice: ranks killed without a new checkpoint"],
        nproc=1,
    ),
    Case("sigkill-of-launcher", [("launcher", signal.SIGKILL)], code=-signal.SIGKILL, nproc=1, goodput=False),
    Case(
        "user-error-in-rank-1",
        env={"TITANLITE_FAULT_USER_ERROR_AT": "2", "TITANLITE_FAULT_RANK": "1"},
        code=2,
        lines=["titanlite: error: fault injection: rank 1 found bad input at step 2"],
        goodput=False,
    ),
    Case(
        "non-finite-loss",
        env={"TITANLITE_FAULT_NAN_AT": "2"},
        code=3,
        lines=["titanlite: error: non-finite step 2: loss nan"],
        nproc=1,
    ),
    Case(
        "ctrl-c-while-the-launcher-starts",
        [("group", signal.SIGINT)],
        code=130,
        lines=["titanlite: SIGINT before any rank started: nothing was trained"],
        nproc=1,
        when="launcher",
        goodput=False,
    ),
    Case(
        "sigterm-while-the-ranks-start-with-restarts",
        [("group", signal.SIGTERM)],
        env={"MAX_RESTARTS": "2"},
        when="ranks",
        rank_line=NOTHING_TRAINED.format("SIGTERM"),
    ),
    Case(
        "ctrl-c-while-the-rank-starts",
        [("group", signal.SIGINT)],
        nproc=1,
        when="ranks",
        rank_line=NOTHING_TRAINED.format("SIGINT"),
    ),
    Case(
        "sigusr1-while-the-rank-starts",
        [("launcher", signal.SIGUSR1)],
        nproc=1,
        when="ranks",
        rank_line=NOTHING_TRAINED.format("SIGUSR1"),
    ),
    Case(
        "sigterm-with-checkpointing-off",
        env={"TITANLITE_FAULT_SIGTERM_AT": "2"},
        code=4,
        lines=[
            "titanlite: error: stop signal (SIGTERM) at step 2: nothing saved (checkpoint.enable = false): the 2 "
            "steps this run trained are lost"
        ],
        nproc=1,
        args=[],
    ),
    Case(
        "crash-in-rank-1",
        env={"TITANLITE_FAULT_CRASH_AT": "2", "TITANLITE_FAULT_RANK": "1"},
        code=1,
        lines=["titanlite: error: rank 1 crashed (the ranks' logs are in ", "Traceback (most recent call last):"],
        traceback=True,
    ),
]


def rank_processes(marker: str, ranks_only: bool = False) -> list[int]:
    """Pids of live processes one of whose command-line arguments is `marker` (the case's own dump
    folder: a whole argument, as `.../ctrl-c` is a prefix of another case's `.../ctrl-c-twice`); with
    `ranks_only` the ranks alone (not run_train.sh, its subshells or the launcher)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if ranks_only and (b"-m\0titanlite.train" not in cmdline or b"titanlite.launcher.launch" in cmdline):
            continue
        if marker.encode() in cmdline.split(b"\0") and state != "Z":
            pids.append(int(entry.name))
    return pids


def handles_stop_signals(pid: int) -> bool:
    """Whether process `pid` has a handler for SIGUSR1 (`SigCgt` in /proc): run_train.sh's first commands and
    the launcher's first instruction install one, long before a rank starts."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGUSR1 - 1) & 1)
    return False


def runs_module(pid: int, module: str) -> bool:
    """Whether process `pid` (run_train.sh, which ends in an exec, through `env --block-signal`) is the
    interpreter running `python -m module` by now (not `env`, whose command line names it too)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1:3] == [b"-m", module.encode()]
    except OSError:
        return False


def is_launcher(pid: int) -> bool:
    """Whether process `pid` (run_train.sh, which ends in an exec of the launcher) is the launcher by now."""
    return runs_module(pid, "titanlite.launcher.launch")


def wait_until(proc: subprocess.Popen, dump: Path, when: str, timeout: float = 180) -> None:
    metrics = dump / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"exited with {proc.returncode} before {when}"
        assert time.monotonic() < deadline, f"no {when}"
        if when == "first step" and metrics.exists() and metrics.read_text().strip():
            return
        # Scanning /proc costs milliseconds at every poll: only the start-up moments read the ranks.
        ranks = rank_processes(str(dump), ranks_only=True) if when != "first step" else []
        if when == "ranks" and ranks:
            return
        if when == "launcher":
            assert not ranks, "the ranks started before the launcher was seen handling signals"
            if is_launcher(proc.pid) and handles_stop_signals(proc.pid):  # not run_train.sh's own traps
                return
        time.sleep(0.1 if when == "first step" else 0.01)


@dataclass
class Outcome:
    returncode: int
    stderr: str
    dump: Path
    survivors: list[int]  # rank processes still alive 10 s after the launcher ended
    temp_left: list[str]  # what the launch left in the system temp folder


def launch(case: Case, dump: Path) -> Outcome:
    tmp = dump.parent / f"{dump.name}.tmp"  # the system temp folder of this launch (TMPDIR)
    tmp.mkdir()
    proc = start_launch(
        ["--job.dump_folder", str(dump), *RUN, *case.args], child_env(NGPU=str(case.nproc), TMPDIR=str(tmp), **case.env)
    )
    try:
        if case.signals:
            wait_until(proc, dump, case.when)
        for target, sig in case.signals:
            os.killpg(proc.pid, sig) if target == "group" else os.kill(proc.pid, sig)
            time.sleep(0.1)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + 10
    while rank_processes(str(dump)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return Outcome(proc.returncode, err, dump, rank_processes(str(dump)), sorted(p.name for p in tmp.iterdir()))


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, Outcome]:
    """Every case, two launches at a time: one launch keeps about one of the two cores busy."""
    root = tmp_path_factory.mktemp("launcher")
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {c.name: pool.submit(launch, c, root / c.name) for c in CASES}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_launcher_signals_and_errors(outcomes, case):
    run = outcomes[case.name]
    err = run.stderr
    assert run.returncode == case.code, err[-4000:]
    assert run.survivors == []  # no rank outlives its launcher, however it ended

    own = [line for line in err.splitlines() if not line.startswith("[rank")]
    # A launch whose ranks started ends with the goodput line, a failed one too (not one that ends in bad
    # input, whose report is one line, nor a launcher killed by SIGKILL).
    ended = [line for line in own if GOODPUT_LINE.fullmatch(line)]
    assert ended == (own[-1:] if case.goodput else []), own
    own = launcher_lines(err)
    if case.traceback:
        [kept] = run.temp_left  # the ranks' logs, named in the report
        assert kept.startswith("torchelastic_") and own[0] == f"{case.lines[0]}{run.dump}.tmp/{kept}):", own[0]
        assert own[1] == case.lines[1] and err.count("Traceback") == 1, err[-4000:]
        assert own[-1] == "RuntimeError: fault injection: rank 1 crashed at step 2"
    else:
        assert len(own) == len(case.lines), err[-4000:]
        assert all(line.startswith(prefix) for line, prefix in zip(own, case.lines)), own
        assert "Traceback" not in err

    # The ranks' log folder (torchelastic_*) is kept only where a report names it (exit code 1), and when
    # the launcher itself was killed.
    assert run.temp_left == [] or run.returncode in (1, -signal.SIGKILL), run.temp_left
    assert "restarting every rank" not in err  # no case restarts: not even after a stop signal
    if case.rank_line:
        assert case.rank_line in err, err[-4000:]
    done = sorted(p.name for p in (run.dump / "checkpoint").glob("step-*") if not p.name.endswith(".partial"))
    if case.saved:
        stopped = [line for line in err.splitlines() if "stop signal" in line]
        step = max(json.loads(line)["step"] for line in (run.dump / "metrics.jsonl").open())
        assert len(stopped) == 1 and f"stop signal ({case.signals[0][1].name}) at step {step}:" in stopped[0]
        assert done == [f"step-{step}"]
    else:
        assert done == []


@pytest.mark.slow
@pytest.mark.parametrize("var,value", [("NGPU", "0"), ("NGPU", "abc"), ("NNODES", "0")])
def test_bad_environment_is_one_line_before_anything_starts(tmp_path, var, value):
    proc = subprocess.run(
        [str(ROOT / "run_train.sh"), "--job.dump_folder", str(tmp_path / "dump")],
        env=child_env(**{var: value}),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"titanlite: error: {var} must be a positive integer") and f"'{value}'" in lines[0]
    assert not (tmp_path / "dump").exists()


def failure(tmp_path: Path, rank: int, exitcode: int, report: tuple[str, int, float] | None = None) -> ProcessFailure:
    """A failed rank as torch's agent sees it; `report` = (message, exit code, time) written as a rank does."""
    path = tmp_path / f"error-{rank}-{time.monotonic_ns()}.json"  # a fresh file for every failure
    if report is not None:
        error = RuntimeError()
        error._titanlite_failed_at = report[2]
        write_failure(str(path), report[0], report[1], error)
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))


def test_root_cause_is_the_user_error_then_an_abrupt_death_then_the_first_traceback(tmp_path):
    gloo = "Traceback (most recent call last):\nRuntimeError: Connection closed by peer"
    user = "titanlite: error: checkpoint step-9 is unusable"
    # A user error wins over a peer's earlier traceback; its exit code is the one the rank meant, even
    # if the rank was stopped by SIGTERM while exiting.
    got = root_cause({0: failure(tmp_path, 0, 1, (gloo, 1, 5.0)), 1: failure(tmp_path, 1, -15, (user, 2, 6.0))}, "L")
    assert (got.text, got.code) == (user, 2)
    # A rank that died without a report (killed, os._exit) is the cause of its peers' tracebacks.
    got = root_cause({0: failure(tmp_path, 0, 1, (gloo, 1, 5.0)), 1: failure(tmp_path, 1, -9)}, "/tmp/logs")
    assert (got.text, got.code) == (
        "titanlite: error: rank 1 was killed by SIGKILL (the ranks' logs are in /tmp/logs)",
        1,
    )
    # Among tracebacks, the earliest.
    boom = "Traceback (most recent call last):\nValueError: boom"
    got = root_cause({0: failure(tmp_path, 0, 1, (gloo, 1, 7.0)), 1: failure(tmp_path, 1, 1, (boom, 1, 6.0))}, "L")
    assert (got.text, got.code) == (f"titanlite: error: rank 1 crashed (the ranks' logs are in L):\n{boom}", 1)


def test_log_rank_naming_no_local_rank_is_one_line_before_anything_starts(tmp_path):
    proc = subprocess.run(
        [str(ROOT / "run_train.sh"), "--job.dump_folder", str(tmp_path / "dump")],
        env=child_env(NGPU="2", LOG_RANK="0,3"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "titanlite: error: LOG_RANK 0,3 names local rank 3, but this node runs 2 (local ranks 0-1): nothing of it "
        "would be shown"
    ], proc.stderr
    assert not (tmp_path / "dump").exists()


def test_the_launcher_reports_a_mistyped_key_before_importing_torch():
    """The launcher's first steps (stop-signal recorder, config check) import no torch, so a typo is one
    line within a second instead of after torch's import (seconds)."""
    code = (
        "import sys\n"
        "from titanlite.launcher import launch\n"
        "from titanlite.errors import run_cli\n"
        "argv = ['--standalone', '--nproc_per_node=2', '-m', 'titanlite.train', '--training.step', '20']\n"
        "rc = run_cli(launch.main, argv)\n"
        "print(rc, 'torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=child_env(), cwd=ROOT, capture_output=True, text=True)
    assert proc.stdout.split() == ["2", "False"], proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        "titanlite: error: unknown config key 'training.step' in the command line; did you mean 'training.steps'?"
    ]


@pytest.mark.parametrize("ngpu", ["2", None], ids=["NGPU-given", "NGPU-counted"])
def test_run_train_reports_a_mistyped_key_before_any_process_imports_torch(ngpu):
    """Through run_train.sh, with NGPU given (the launcher checks the config) and without it (counting the
    GPUs imports torch, so run_train.sh checks the config first): one line, exit code 2, and no process
    of the launch imported torch (Python's own import log, PYTHONPROFILEIMPORTTIME, names every import)."""
    env = child_env(PYTHONPROFILEIMPORTTIME="1")
    env.pop("NGPU", None)
    if ngpu:
        env["NGPU"] = ngpu
    proc = subprocess.run(
        [str(ROOT / "run_train.sh"), "--training.step", "20"], env=env, cwd=ROOT, capture_output=True, text=True
    )
    imported = [line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert "titanlite.errors" in imported and "torch" not in imported, imported
    own = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 2 and own == [
        "titanlite: error: unknown config key 'training.step' in the command line; did you mean 'training.steps'?"
    ], proc.stderr[-3000:]


@pytest.mark.slow
def test_the_launchers_preflight_imports_neither_dtensor_nor_the_compiler(tmp_path):
    """The launcher's agent and its preflight (run plan, data loader, checkpoint folders) run before any
    rank starts, single-threaded: they import neither DTensor (nor DCP or FSDP2, which import it) nor
    torch's compiler, about a second of start-up per launch. Checked for eager runs of each layout kind;
    a compiled run's preflight imports the compiler to check its settings."""
    heavy = ["torch.distributed.tensor", "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch._dynamo"]
    code = (
        "import sys\n"
        "import titanlite.launcher.agent\n"
        "from titanlite.launcher.preflight import preflight\n"
        f"base = ['--job.dump_folder', {str(tmp_path)!r}]\n"
        "for layout in ([], ['--parallelism.tensor_parallel_degree', '2'], "
        "['--parallelism.pipeline_parallel_degree', '2'], ['--parallelism.context_parallel_degree', '2']):\n"
        "    preflight(base + layout, 2)\n"
        f"print([m for m in {heavy!r} if m in sys.modules])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=child_env(), cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", proc.stdout


def test_a_finished_process_exits_with_its_code_after_its_threads_exit_functions_and_output():
    """`errors.exit_now`, the end of every rank, launcher and torch tool: the process's other threads
    finish (an idle thread pool's too, as compiled runs leave one), its `atexit` functions run and what it
    printed arrives, and the exit code is the one given;
    only the interpreter's teardown is skipped (a plain `os._exit` loses all three: the control)."""
    script = """if True:
        import atexit, concurrent.futures, sys, threading, time
        from titanlite.errors import exit_now
        atexit.register(lambda: print("exit function ran", flush=True))
        threading.Thread(target=lambda: (time.sleep(0.2), print("thread finished", flush=True))).start()
        pool = concurrent.futures.ThreadPoolExecutor(1)  # kept: its idle worker must not block the exit
        pool.submit(time.sleep, 0)
        sys.stdout.write("unflushed line\\n")
        {end}(3)
    """
    done = ["unflushed line", "thread finished", "exit function ran"]
    env = {k: v for k, v in child_env().items() if k != "PYTHONUNBUFFERED"}  # stdout a buffered pipe
    for end, lines in (("exit_now", done), ("__import__('os')._exit", [])):
        command = [sys.executable, "-c", script.format(end=end)]
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=20)
        assert (proc.returncode, proc.stdout.splitlines()) == (3, lines), proc.stderr


def session_processes(sid: int) -> list[str]:
    """The live processes of session `sid` (a launch started in a session of its own), as command lines."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:
            found.append(cmdline)
    return found


def sigint_default(pid: int) -> bool:
    """Whether process `pid` no longer ignores SIGINT (bit 2 of `SigIgn` in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return not int(line.split()[1], 16) >> (signal.SIGINT - 1) & 1
    return False


EARLY = [
    (sig, target, delay, ngpu)
    for sig, target in ((signal.SIGINT, "group"), (signal.SIGTERM, "launcher"), (signal.SIGTERM, "group"))
    for delay, ngpu in ((0.1, "1"), (0.3, None), (0.5, "1"))
]


def start_run_train(args: list[str], ngpu: str | None = None) -> subprocess.Popen:
    """`run_train.sh args` in a session of its own (its process group is the launch's), output piped."""
    env = child_env()
    env.pop("NGPU", None)
    if ngpu:
        env["NGPU"] = ngpu
    # A Ctrl-C reaches a job only where SIGINT is not ignored (a background job of a non-interactive shell
    # starts with it ignored, and bash cannot reset that): `env --default-signal` resets it before exec.
    return subprocess.Popen(
        ["env", "--default-signal=INT", str(ROOT / "run_train.sh"), *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def stopped_early(sig: signal.Signals, target: str, delay: float, ngpu: str | None, dump: Path) -> tuple:
    """`run_train.sh` signalled `delay` seconds after its first command (its set-up, the config check,
    counting the GPUs, the launcher's imports): its exit code, its stderr lines (which end only once every process
    holding the pipe has ended) and the processes of its session still there after (none may outlive it)."""
    proc = start_run_train(["--job.dump_folder", str(dump), *SMALL], ngpu)
    try:
        start = time.monotonic()
        # From the script's first command on, its traps hold the stop signals (before bash runs it, a signal
        # takes its default action: nothing has started; docs/failure_handling.md).
        while not (sigint_default(proc.pid) and handles_stop_signals(proc.pid)):
            time.sleep(0.002)
        time.sleep(max(0.0, delay - (time.monotonic() - start)))
        os.killpg(proc.pid, sig) if target == "group" else os.kill(proc.pid, sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    time.sleep(0.5)
    return proc.returncode, err.splitlines(), session_processes(proc.pid)


@pytest.mark.slow
def test_a_stop_signal_in_the_first_half_second_is_one_line_and_leaves_no_process(tmp_path):
    """Ctrl-C or SIGTERM while run_train.sh sets up, checks the config, counts the GPUs or while the
    launcher imports, from the script's first command on: the documented line and exit code 128 + signal
    at every moment, no traceback, and no child process left behind."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            case: pool.submit(stopped_early, *case, tmp_path / f"{case[0].name}-{case[1]}-{case[2]}-{case[3]}")
            for case in EARLY
        }
        results = {case: f.result() for case, f in futures.items()}
    line = "titanlite: {} before any rank started: nothing was trained"
    wrong = [
        (f"{sig.name} to the {target} after {delay} s (NGPU={ngpu})", code, lines[-3:], left)
        for (sig, target, delay, ngpu), (code, lines, left) in results.items()
        if (code, lines, left) != (128 + sig, [line.format(sig.name)], [])
    ]
    assert wrong == [], "\n".join(map(str, wrong))


TOOL_STOPS = [
    # (signal, run_train.sh's arguments, its tool, while it imports (its handler not there yet) or after)
    (signal.SIGINT, ["--config", "train_configs/llama3_405b.toml", "--dry-run"], "titanlite.tools.dry_run", False),
    (signal.SIGTERM, ["--config", "train_configs/llama3_8b.toml", "--plan"], "titanlite.tools.layout_search", True),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig,args,tool,handled", TOOL_STOPS, ids=["ctrl-c-dry-run-importing", "sigterm-plan-searching"]
)
def test_a_stop_signal_during_a_dry_run_or_a_layout_search_is_one_line(tmp_path, sig, args, tool, handled):
    """The tools run_train.sh runs in place of a launch stop as a launch does before any rank: the documented
    line and exit code 128 + signal, no traceback and no process left, whether the signal comes while the
    tool imports (run_train.sh starts it with the stop signals blocked) or once it plans."""
    proc = start_run_train([*args, "--job.dump_folder", str(tmp_path)])
    try:
        deadline = time.monotonic() + 60
        while not runs_module(proc.pid, tool) or (handled and not handles_stop_signals(proc.pid)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.002)
        importing = not handles_stop_signals(proc.pid)
        time.sleep(1.0 if handled else 0.0)
        os.killpg(proc.pid, sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert importing != handled  # the moment the case names
    line = f"titanlite: {sig.name} before any rank started: nothing was trained"
    assert (proc.returncode, err.splitlines(), session_processes(proc.pid)) == (128 + sig, [line], [])
