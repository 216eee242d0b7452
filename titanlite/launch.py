"""The launcher: `python -m titanlite.launch [torchrun options] -m titanlite.train [--config FILE ...]`.

It takes torchrun's command line and runs torch's elastic agent (`LocalElasticAgent`, what torchrun
runs) to start, watch and restart the ranks of this node. Around it, it gives a scheduler and a terminal
what they expect of a job's first process:

* Stop signals. SIGTERM, SIGUSR1 and the first SIGINT (Ctrl-C), sent to the launcher alone or to its
  process group, are forwarded once to every rank; the ranks agree on the next step boundary, save and
  exit (`resilience.Preemption`), and the launcher exits 0. It waits `comm.stop_grace_seconds` for
  them, then kills them (exit code 128 + signal). A second Ctrl-C kills them at once (exit code 130).
  SIGHUP and SIGQUIT end the run at once through torch's own handling; signals ignored when the
  launcher started (SIGHUP under `nohup`) stay ignored. torch starts every rank in a session of its
  own, so a signal to the launcher's group reaches the ranks only through the launcher: exactly once.
* Death of the launcher. Every rank asks Linux to kill it when the launcher dies
  (`resilience.follow_launcher`): a SIGKILL of the launcher leaves no rank training on.
* One error contract. A failing rank writes its report into the error file torch elastic gives it
  instead of its own output (`resilience.run_rank`); the launcher prints the root cause once: a
  `UserError` as its one `titanlite: error: ...` line with exit code 2 (3 for divergence), a crash as
  the rank's traceback with exit code 1. Failures that a restart cannot fix (exit codes 2 and 3) are not
  restarted. torch elastic's own log (every failure, every shutdown step) is shown with `LOGLEVEL=INFO`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import uuid
from dataclasses import dataclass
from types import FrameType

import torch.distributed.elastic.rendezvous.registry as rdzv_registry
from torch.distributed.elastic.agent.server import WorkerSpec
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousParameters
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.run import config_from_args, parse_args, parse_min_max_nnodes

from titanlite.config import DEFAULT_CONFIG, load_config
from titanlite.errors import EXIT_DIVERGED, EXIT_USER_ERROR, run_cli
from titanlite.preflight import preflight
from titanlite.resilience import LAUNCHER_PID_ENV

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
IMMEDIATE_SIGNALS = (signal.SIGHUP, signal.SIGQUIT)  # left to torch: it sends them on to the ranks and shuts down
EXIT_INTERRUPTED = 128 + signal.SIGINT


class Agent(LocalElasticAgent):
    """torch's agent, except that ranks which failed on bad input or divergence are not restarted: the
    same input fails the same way again."""

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.is_failed() and any(f.exitcode in (EXIT_USER_ERROR, EXIT_DIVERGED) for f in result.failures.values()):
            self._remaining_restarts = 0  # the agent's own budget: it then stops instead of restarting
        return result


def handled(signals: tuple[signal.Signals, ...]) -> list[signal.Signals]:
    """The signals not ignored when the launcher started: `nohup` (SIGHUP) and a background job of a
    non-interactive shell (SIGINT) keep their meaning."""
    return [sig for sig in signals if signal.getsignal(sig) is not signal.SIG_IGN]


class Stopper:
    """The launcher's handlers of stop signals: forward the first to every rank once, bound the wait by
    the grace period (SIGALRM), and turn a second Ctrl-C or the end of the grace period into torch's
    `SignalException` with SIGKILL, which makes the agent kill every rank's process group."""

    def __init__(self, grace_seconds: float) -> None:
        self.grace_seconds = grace_seconds
        self.agent: Agent | None = None
        self.received: signal.Signals | None = None
        self.reason, self.code = "", 0
        for sig in handled(STOP_SIGNALS):
            signal.signal(sig, self._on_stop_signal)
        signal.signal(signal.SIGALRM, self._on_grace_over)

    def _rank_pids(self) -> list[int]:
        if self.agent is None:
            return []
        return [w.id for w in self.agent.get_worker_group().workers if isinstance(w.id, int)]

    def _on_stop_signal(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self.received is not None:
            if sig == signal.SIGINT:
                first = "twice" if self.received == signal.SIGINT else f"after {self.received.name}"
                self._kill(f"interrupted {first}: ranks killed without a new checkpoint", EXIT_INTERRUPTED)
            return  # already stopping: a repeated SIGTERM/SIGUSR1 changes nothing
        self.received = sig
        sent = 0
        for pid in self._rank_pids():
            try:
                os.kill(pid, sig)
                sent += 1
            except ProcessLookupError:
                pass
        if not sent:
            self._kill(f"{sig.name} before the ranks started: nothing to save", 128 + sig)
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
            (user if data["exit_code"] in (EXIT_USER_ERROR, EXIT_DIVERGED) else crashed).append((data["time"], rank, f))
        elif isinstance(data.get("message"), dict):  # torch's own error-file format (`errors.record`)
            crashed.append((float(f.timestamp), rank, f))
        else:
            abrupt.append((float(f.timestamp), rank, f))
    if user:
        # The code the rank meant: it may still be killed while exiting (torch stops the other ranks with
        # SIGTERM once one has failed, and Python restores default handlers as it shuts down).
        _, _, f = min(user)
        return Report(f.error_file_data["message"], f.error_file_data["exit_code"])
    if abrupt:
        _, rank, f = min(abrupt)
        how = f"was killed by {f.signal_name()}" if f.exitcode < 0 else f"exited with code {f.exitcode}"
        return Report(f"titanlite: error: rank {rank} {how} (the ranks' logs are in {log_dir})", 1)
    _, rank, f = min(crashed)
    message = f.error_file_data["message"]
    text = message if isinstance(message, str) else message.get("extraInfo", {}).get("py_callstack", str(message))
    return Report(f"titanlite: error: rank {rank} crashed:\n{text.rstrip()}", 1)


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
    """What `main` needs of the command line: the agent, the grace period, where the ranks' logs go."""

    agent: Agent
    grace_seconds: float
    log_dir: str


def build_launch(argv: list[str]) -> Launch:
    """torchrun's command line -> torch's agent (built as `torch.distributed.run` builds it), the grace
    period from the trainer's config, and where torch elastic keeps the ranks' logs."""
    args = parse_args(argv)
    nnodes = parse_min_max_nnodes(args.nnodes)[1]
    one_node = nnodes == 1
    # The preflight, in this process (one interpreter start less per launch): bad input is one line and
    # exit code 2 before any rank starts. Its restart budget applies unless --max-restarts was given.
    nproc = int(args.nproc_per_node) if str(args.nproc_per_node).isdigit() else 1
    restarts = preflight(list(args.training_script_args), nproc * nnodes)
    if not any(a.startswith(("--max-restarts", "--max_restarts")) for a in argv):
        args.max_restarts = restarts
    implicit = args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None and one_node
    if args.standalone or implicit:  # as torchrun: a private c10d store on a free port
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    grace = load_config(args.training_script_args, default_config=DEFAULT_CONFIG).comm.stop_grace_seconds
    config, entrypoint, entry_args = config_from_args(args)
    config.signals_to_handle = ",".join(sig.name for sig in handled(IMMEDIATE_SIGNALS))
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
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
    return Launch(agent, grace, config.logs_specs.root_log_dir)


def main(argv: list[str]) -> int:
    quiet_torch_elastic()
    cfg = load_config(list(parse_args(argv).training_script_args), default_config=DEFAULT_CONFIG)
    if cfg.job.print_config:  # the merged config, and nothing is launched
        print(cfg.to_json(), flush=True)
        return 0
    launch = build_launch(argv)
    agent = launch.agent
    stopper = Stopper(launch.grace_seconds)
    stopper.agent = agent
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # inherited by the ranks (resilience.follow_launcher)
    rdzv_handler = agent.get_worker_group().spec.rdzv_handler
    try:
        result = agent.run()
    except SignalException as e:
        # Ours (a second Ctrl-C, the grace period) or torch's (SIGHUP, SIGQUIT); the ranks are gone. The
        # rendezvous stays open, as torchrun leaves it, for the other nodes to notice.
        stopper.cancel()
        if stopper.reason:
            print(f"titanlite: {stopper.reason}", file=sys.stderr, flush=True)
            return stopper.code
        print(f"titanlite: {e.sigval.name}: ranks stopped without a new checkpoint", file=sys.stderr, flush=True)
        return 128 + e.sigval
    except RendezvousError as e:
        print(f"titanlite: error: rendezvous failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    stopper.cancel()
    rdzv_handler.shutdown()
    if not result.is_failed():
        return 0
    report = root_cause(result.failures, launch.log_dir)
    print(report.text, file=sys.stderr, flush=True)
    return report.code


if __name__ == "__main__":
    try:
        sys.exit(run_cli(main))
    except KeyboardInterrupt:  # Ctrl-C before the stop handlers are in place: nothing has started
        print("titanlite: interrupted", file=sys.stderr, flush=True)
        sys.exit(EXIT_INTERRUPTED)
