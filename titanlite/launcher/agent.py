"""The launcher's agent: torch's elastic agent (`LocalElasticAgent`, what torchrun runs) with titanlite's
stop signals, restart rule, hang watchdog and error report; `titanlite.launcher.launch` checks the command
line, then calls `launch` here (this module imports torch).

The first stop signal is forwarded once to every rank (`Stopper`) and no rank is restarted after it;
failures a restart cannot fix (exit codes 2, 3, 4) are not restarted, and every restart is announced
with its cause; ranks that stop progressing are caught by `hang_watchdog.py`; the root cause is printed
once (`root_cause`); the launcher hosting rank 0 writes its rows of the goodput ledger
(`launch_ledger.py`) and prints the job's goodput line last. The ranks' log folder (torch elastic's, in
the system temp folder) is removed at the end, except after a crash, whose report names it.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import torch.distributed.elastic.rendezvous.registry as rdzv_registry
from torch.distributed.elastic.agent.server import WorkerSpec
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousParameters
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.run import config_from_args, parse_args, parse_min_max_nnodes

from titanlite.config import DEFAULT_CONFIG, load_config
from titanlite.errors import EXIT_DIVERGED, EXIT_HUNG, EXIT_NOT_SAVED, EXIT_USER_ERROR
from titanlite.launcher.hang_watchdog import Hang, HangWatchdog, nccl_pipe_env
from titanlite.launcher.launch_ledger import LaunchLedger
from titanlite.launcher.preflight import check_run
from titanlite.run.progress import PROGRESS_DIR_ENV, read_progress
from titanlite.run.rank_exit import LAUNCHER_PID_ENV
from titanlite.run.signals import STOP_SIGNALS, Preemption, before_any_rank, blocked, handled

IMMEDIATE_SIGNALS = (signal.SIGHUP, signal.SIGQUIT)  # left to torch: it sends them on to the ranks and shuts down
EXIT_INTERRUPTED = 128 + signal.SIGINT
FINAL = (EXIT_USER_ERROR, EXIT_DIVERGED, EXIT_NOT_SAVED)
"""Rank exit codes a restart cannot fix: the same input, data or disk fails the same way again."""


class Stopper:
    """The launcher's handlers of stop signals: forward the first to every rank once, bound the wait by
    the grace period (SIGALRM), and turn a second Ctrl-C, the end of the grace period or a signal while
    no rank runs into torch's `SignalException` with SIGKILL, which makes the agent kill every rank's
    process group. `received` starts as what the launcher recorded before the agent existed. torch starts
    every rank in a session of its own, so a signal to the launcher's group reaches the ranks only through
    here: exactly once."""

    def __init__(self, grace_seconds: float, agent: Agent, received: int | None) -> None:
        self.grace_seconds, self.agent = grace_seconds, agent
        self.received = signal.Signals(received) if received is not None else None
        self.forwarded = False
        self.reason, self.code = "", 0

    def install(self) -> None:
        """Take the stop signals over; one recorded before (while the launcher started) ends the launch."""
        for sig in handled(STOP_SIGNALS):
            signal.signal(sig, self._on_stop_signal)
        signal.signal(signal.SIGALRM, self._on_grace_over)
        if self.received is not None:
            self._kill(before_any_rank(self.received.name), 128 + self.received)

    def _rank_pids(self) -> list[int]:
        return [w.id for w in self.agent.get_worker_group().workers if isinstance(w.id, int)]

    def _on_stop_signal(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self.received is not None:
            if sig == signal.SIGINT:
                first = "twice" if self.received == signal.SIGINT else f"after {self.received.name}"
                self._kill(f"interrupted {first}: ranks killed without a new checkpoint", EXIT_INTERRUPTED)
            return  # already stopping: a repeated SIGTERM/SIGUSR1 changes nothing
        self.received = sig
        if self.agent.spawning:  # the new ranks' pids are not known yet: `forward` runs once they are
            return
        self.forward()

    def forward(self) -> None:
        """Send the received stop signal to every rank, once, and start the grace period; with no rank
        running, end the launch."""
        assert self.received is not None
        if self.forwarded:
            return
        self.forwarded, sig = True, self.received
        sent = 0
        for pid in self._rank_pids() if self.agent.running else []:
            try:
                os.kill(pid, sig)
                sent += 1
            except ProcessLookupError:
                pass
        if not sent:
            when = "while the ranks restarted" if self.agent.started else "before any rank started"
            self._kill(f"{sig.name} {when}: stopped without a new checkpoint", 128 + sig)
        signal.setitimer(signal.ITIMER_REAL, self.grace_seconds)

    def _on_grace_over(self, signum: int, frame: FrameType | None) -> None:
        assert self.received is not None
        self._kill(
            f"the ranks did not stop within comm.stop_grace_seconds = {self.grace_seconds:g} s of "
            f"{self.received.name}: killed them, without a new checkpoint",
            128 + self.received,
        )

    def _kill(self, reason: str, code: int) -> None:
        self.reason, self.code = reason, code
        raise SignalException(reason, sigval=signal.SIGKILL)

    def cancel(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)


class Agent(LocalElasticAgent):
    """torch's agent, with the restart rule of the module docstring; `stopper` and `log_dir` are set by
    `launch` before `run()`."""

    stopper: Stopper | None = None
    watchdog: HangWatchdog | None = None
    ledger: LaunchLedger | None = None
    hang: Hang | None = None
    """The last hang caught (its report when no restart was left)."""
    _watched = 0.0
    log_dir = ""
    started = False
    """Ranks were started at least once."""
    running = False
    """The ranks of the current attempt have been started (their pids are known)."""
    spawning = False
    """The ranks of the current attempt are being started."""

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, int]:
        # The ranks inherit the blocked stop signals (signals.py). A stop signal that arrives meanwhile
        # (another thread of this process may take it) is only recorded, and forwarded once the new
        # ranks' pids are known.
        self.spawning = True
        if self.ledger is not None:
            hosting = any(w.global_rank == 0 for w in worker_group.workers)
            os.environ.update(self.ledger.attempt(hosting, self.rank0_step()))  # inherited by the ranks
        if self.watchdog is not None:
            self.watchdog.reset()
        try:
            with blocked():
                ids = super()._start_workers(worker_group)
                for local_rank, pid in ids.items():
                    worker_group.workers[local_rank].id = pid
                self.started = self.running = True
        finally:
            self.spawning = False
        if self.stopper is not None and self.stopper.received is not None:
            self.stopper.forward()
        return ids

    def rank0_step(self) -> int | None:
        """The step rank 0 of the last attempt last finished, by its progress file (None without the
        watchdog, or where rank 0 runs on another node)."""
        if self.watchdog is None or (progress := read_progress(self.watchdog.folder, 0)) is None:
            return None
        return progress[0]

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self.running = False
        super()._stop_workers(worker_group)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        hang = self._watch(worker_group) if result.state == WorkerState.HEALTHY else None
        if hang is not None:
            result = RunResult(state=WorkerState.FAILED)  # no rank failed: the launch reports `self.hang`
        if not result.is_failed():
            return result
        stopping = self.stopper is not None and self.stopper.received is not None
        if stopping or any(f.exitcode in FINAL for f in result.failures.values()):
            self._remaining_restarts = 0  # the agent's own budget: it then stops instead of restarting
        elif self._remaining_restarts > 0:
            spec = worker_group.spec
            done = spec.max_restarts - self._remaining_restarts + 1
            cause = hang.line() if hang else root_cause(result.failures, self.log_dir).text
            why = cause.removeprefix("titanlite: error: ")
            print(
                f"titanlite: restarting every rank (restart {done} of {spec.max_restarts}) after: {why}",
                file=sys.stderr,
                flush=True,
            )
        return result

    def _watch(self, worker_group: WorkerGroup) -> Hang | None:
        """About once a second, ask the hang watchdog; on a hang, capture it and kill every rank."""
        now = time.monotonic()
        if self.watchdog is None or now - self._watched < 1.0:
            return None
        self._watched = now
        pids = {w.global_rank: w.id for w in worker_group.workers if isinstance(w.id, int)}
        idle = self.watchdog.idle(list(pids), now)
        if idle is None:
            return None
        self.hang = self.watchdog.capture(pids, idle)
        assert self._pcontext is not None
        self._pcontext.close(signal.SIGKILL)  # a stop signal would wait for a step boundary that never comes
        self.running = False
        return self.hang


@dataclass
class Report:
    """What the user sees of a failed run: the text for stderr and the exit code."""

    text: str
    code: int


def root_cause(failures: dict[int, ProcessFailure], log_dir: str) -> Report:
    """The failure to report, once. A rank's own `UserError` first (the deliberate report); then a rank
    that died without a report (killed, or exited abruptly): the peers' errors that follow are its
    consequences; else the earliest traceback."""
    user, abrupt, crashed = [], [], []
    for rank, f in sorted(failures.items()):
        data = f.error_file_data
        if isinstance(data.get("message"), str) and "exit_code" in data:
            (user if data["exit_code"] in FINAL else crashed).append((data["time"], rank, f))
        elif isinstance(data.get("message"), dict):  # torch's own error-file format (`errors.record`)
            crashed.append((float(f.timestamp), rank, f))
        else:
            abrupt.append((float(f.timestamp), rank, f))
    if user:
        # The code the rank meant: it may still be killed while exiting (torch stops the other ranks with
        # SIGTERM once one has failed, and Python restores default handlers as it shuts down).
        _, _, f = min(user)
        return Report(f.error_file_data["message"], f.error_file_data["exit_code"])
    logs = f"the ranks' logs are in {log_dir}"
    if abrupt:
        _, rank, f = min(abrupt)
        how = f"was killed by {f.signal_name()}" if f.exitcode < 0 else f"exited with code {f.exitcode}"
        return Report(f"titanlite: error: rank {rank} {how} ({logs})", 1)
    _, rank, f = min(crashed)
    message = f.error_file_data["message"]
    text = message if isinstance(message, str) else message.get("extraInfo", {}).get("py_callstack", str(message))
    return Report(f"titanlite: error: rank {rank} crashed ({logs}):\n{text.rstrip()}", 1)


def quiet_torch_elastic() -> None:
    """torch elastic logs each failure, each shutdown step and its ChildFailedError summary; the launcher
    reports the outcome itself. `LOGLEVEL` (torch's own variable) brings that log back."""
    if "LOGLEVEL" in os.environ:
        return
    log = logging.getLogger("torch.distributed.elastic")
    log.addHandler(logging.NullHandler())
    log.propagate = False


@dataclass
class Launch:
    """What `launch` needs of the command line: the agent, the grace period, the ranks' log folder and
    whether the user chose that folder (`--log-dir`: then it is kept)."""

    agent: Agent
    grace_seconds: float
    log_dir: str
    own_log_dir: bool
    watchdog: HangWatchdog | None
    ledger: LaunchLedger


def build_launch(argv: list[str]) -> Launch:
    """torchrun's command line -> torch's agent (built as `torch.distributed.run` builds it), the grace
    period from the trainer's config (loaded once here, for the preflight and the agent), and where torch
    elastic keeps the ranks' logs."""
    args = parse_args(argv)
    nnodes = parse_min_max_nnodes(args.nnodes)[1]
    one_node = nnodes == 1
    # The preflight, in this process (one interpreter start less per launch): bad input is one line and
    # exit code 2 before any rank starts. Its restart budget applies unless --max-restarts was given.
    nproc = int(args.nproc_per_node) if str(args.nproc_per_node).isdigit() else 1
    cfg = check_run(load_config(list(args.training_script_args), default_config=DEFAULT_CONFIG), nproc * nnodes).cfg
    if not any(a.startswith(("--max-restarts", "--max_restarts")) for a in argv):
        args.max_restarts = cfg.comm.max_restarts
    implicit = args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None and one_node
    if args.standalone or implicit:  # as torchrun: a private c10d store on a free port
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    grace = cfg.comm.stop_grace_seconds
    config, entrypoint, entry_args = config_from_args(args)
    config.signals_to_handle = ",".join(sig.name for sig in handled(IMMEDIATE_SIGNALS))
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    # One rank line prefix, `[rank<r>]: `; the ranks' own log lines then name no rank (rank_logging.init_logging).
    config.log_line_prefix_template = "[rank${rank}]: "
    rdzv = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    master_addr, master_port = None, None
    if config.rdzv_backend == "static":
        master_addr, master_port = parse_rendezvous_endpoint(config.rdzv_endpoint, default_port=-1)
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(entry_args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(rdzv),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=config.local_addr,
        numa_options=config.numa_options,
        duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters,
        virtual_local_rank=config.virtual_local_rank,
    )
    # torch 2.11's agent has no shutdown_timeout (torchrun's --shutdown-timeout came in 2.12): its own default.
    shutdown = {"shutdown_timeout": config.shutdown_timeout} if hasattr(config, "shutdown_timeout") else {}
    agent = Agent(
        spec=spec,
        logs_specs=config.logs_specs,
        start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template,
        **shutdown,
    )
    log_dir = config.logs_specs.root_log_dir
    watchdog = None
    if cfg.comm.hang_timeout_seconds > 0:
        progress = Path(log_dir) / "progress"
        progress.mkdir(parents=True, exist_ok=True)
        relaxed = cfg.comm.init_timeout_seconds
        watchdog = HangWatchdog(progress, cfg.comm.hang_timeout_seconds, relaxed, cfg.job.dump_folder)
    ledger = LaunchLedger(cfg.job.dump_folder)
    return Launch(agent, grace, log_dir, own_log_dir=bool(args.log_dir), watchdog=watchdog, ledger=ledger)


def launch(argv: list[str], early: Preemption) -> int:
    """Run the ranks of this node; `early` holds a stop signal received while the launcher started."""
    quiet_torch_elastic()
    spec = build_launch(argv)
    agent = spec.agent
    agent.log_dir = spec.log_dir
    agent.ledger = spec.ledger
    stopper = agent.stopper = Stopper(spec.grace_seconds, agent, early.received)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # inherited by the ranks (rank_exit.follow_launcher)
    if spec.watchdog is not None:  # inherited by the ranks (progress.Progress)
        agent.watchdog = spec.watchdog
        os.environ[PROGRESS_DIR_ENV] = str(spec.watchdog.folder)
        for key, value in nccl_pipe_env(spec.watchdog.folder).items():
            os.environ.setdefault(key, value)
    rdzv_handler = agent.get_worker_group().spec.rdzv_handler
    code = 1
    try:
        stopper.install()
        result = agent.run()
        stopper.cancel()
        rdzv_handler.shutdown()
        code = 0
        if result.is_failed() and not result.failures and agent.hang is not None:
            print(f"titanlite: error: {agent.hang.line()}", file=sys.stderr, flush=True)
            code = EXIT_HUNG
        elif result.is_failed():
            report = root_cause(result.failures, spec.log_dir)
            print(report.text, file=sys.stderr, flush=True)
            code = report.code
    except SignalException as e:
        # Ours (a stop signal while no rank runs, a second Ctrl-C, the grace period) or torch's (SIGHUP,
        # SIGQUIT); the ranks are gone. The rendezvous stays open, as torchrun leaves it, for the other
        # nodes to notice.
        stopper.cancel()
        if stopper.reason:
            print(f"titanlite: {stopper.reason}", file=sys.stderr, flush=True)
            code = stopper.code
        else:
            print(f"titanlite: {e.sigval.name}: ranks stopped without a new checkpoint", file=sys.stderr, flush=True)
            code = 128 + e.sigval
    except RendezvousError as e:
        print(f"titanlite: error: rendezvous failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    finally:
        if (line := spec.ledger.end(code, agent.rank0_step())) is not None:
            print(line, file=sys.stderr, flush=True)
        if code != 1 and not spec.own_log_dir:  # a crash's report names the folder: it stays
            shutil.rmtree(spec.log_dir, ignore_errors=True)
    return code
