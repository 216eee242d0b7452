"""The launcher: `python -m titanlite.launcher.launch [torchrun options] -m titanlite.train [--config FILE ...]`.

It takes torchrun's command line and runs torch's elastic agent (`agent.py`) to start, watch and
restart the ranks of this node. Around it, it gives a scheduler and a terminal what they expect of a
job's first process:

* Start-up order. The stop-signal recorder is its first instruction; then the training command's config
  is read and checked, without torch (a mistyped key is one line within a second); only then come
  `import torch` (seconds), the preflight and the agent.
* Stop signals. SIGTERM, SIGUSR1 and the first SIGINT (Ctrl-C), sent to the launcher alone or to its
  process group, are forwarded once to every rank; the ranks agree on the next step boundary, save and
  exit (`signals.Preemption`), and the launcher exits 0 (4 when the save failed or checkpointing is
  off). A signal is never lost: one received while the launcher starts ends it before any rank starts
  (exit code 128 + signal); ranks start with it blocked and honour it once their handler exists (a
  rank that has trained nothing stops with nothing to save, exit 0); no rank is restarted after it. The
  launcher waits `comm.stop_grace_seconds` for them, then kills them (exit code 128 + signal). A second
  Ctrl-C kills them at once (exit code 130). SIGHUP and SIGQUIT end the run at once through torch's own
  handling; signals ignored when the launcher started (SIGHUP under `nohup`) stay ignored. torch starts
  every rank in a session of its own, so a signal to the launcher's group reaches the ranks only
  through the launcher: exactly once.
* Death of the launcher. Every rank asks Linux to kill it when the launcher dies
  (`rank_exit.follow_launcher`): a SIGKILL of the launcher leaves no rank training on.
* One error contract. A failing rank writes its report into the error file torch elastic gives it
  instead of its own output (`rank_exit.run_rank`); the launcher prints the root cause once: a
  `UserError` as its one `titanlite: error: ...` line with exit code 2 (3 for divergence, 4 for work
  that could not be saved), a crash as the rank's traceback with exit code 1. Failures that a restart
  cannot fix (exit codes 2, 3 and 4) are not restarted; a restart is announced with its cause. torch
  elastic's own log (every failure, every shutdown step) is shown with `LOGLEVEL=INFO`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from titanlite.errors import ConfigError, exit_now, run_cli
from titanlite.run.signals import Preemption, before_any_rank

EXIT_INTERRUPTED = 128 + signal.SIGINT


def training_args(argv: list[str]) -> list[str] | None:
    """The training command's arguments (what follows `-m MODULE`), found without torchrun's parser,
    which imports torch; None when the command is not a module."""
    for i, arg in enumerate(argv):
        if arg in ("-m", "--module") and i + 1 < len(argv):
            return argv[i + 2 :]
    return None


def option(argv: list[str], *names: str) -> str | None:
    """The value of a launcher option given as `--name value` or `--name=value` (before the module)."""
    end = argv.index("-m") if "-m" in argv else len(argv)
    for i, arg in enumerate(argv[:end]):
        for name in names:
            if arg == name and i + 1 < end:
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def check_log_ranks(argv: list[str]) -> None:
    """The local ranks whose output is shown (`LOG_RANK`, torchrun's `--local-ranks-filter`) exist on
    this node: naming none of them would show nothing at all."""
    shown = option(argv, "--local-ranks-filter", "--local_ranks_filter")
    nproc = option(argv, "--nproc-per-node", "--nproc_per_node")
    if not shown or not nproc or not nproc.isdigit():
        return
    missing = [r for r in shown.split(",") if r.strip().isdigit() and int(r) >= int(nproc)]
    if missing:
        raise ConfigError(
            f"LOG_RANK {shown} names local rank {', '.join(missing)}, but this node runs {nproc} "
            f"(local ranks 0-{int(nproc) - 1}): nothing of it would be shown"
        )


def main(argv: list[str]) -> int:
    early = Preemption(interrupt=True)  # first: a stop signal during the imports below is remembered
    # What the preflight warns about (data files skipped, ...) is printed once, here, not by every rank.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("titanlite: warning: %(message)s"))
    handler.setLevel(logging.WARNING)
    logging.getLogger("titanlite").addHandler(handler)
    from titanlite.config import DEFAULT_CONFIG, load_config

    args = training_args(argv)
    if args is not None:
        cfg = load_config(args, default_config=DEFAULT_CONFIG)  # bad input: one line, before torch is imported
        if cfg.job.print_config:  # the merged config, and nothing is launched
            print(cfg.to_json(), flush=True)
            return 0
    check_log_ranks(argv)
    if early.received is not None:  # already stopped: no need to import torch to start nothing
        print(f"titanlite: {before_any_rank(early.name)}", file=sys.stderr, flush=True)
        return 128 + early.received
    # torch's C++ warnings of the launcher's own store and rendezvous (a peer node's agent gone first, say)
    # are for torch's developers, not the user: off, unless asked for. c10 reads the level when torch is
    # imported; the ranks get the user's environment back.
    quiet = "TORCH_CPP_LOG_LEVEL" not in os.environ
    if quiet:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    from titanlite.launcher.agent import launch  # torch: seconds

    if quiet:
        del os.environ["TORCH_CPP_LOG_LEVEL"]
    return launch(argv, early)


if __name__ == "__main__":
    try:
        code = run_cli(main)
    except KeyboardInterrupt:  # Ctrl-C twice while the launcher starts: nothing has started
        print("titanlite: interrupted", file=sys.stderr, flush=True)
        sys.exit(EXIT_INTERRUPTED)
    exit_now(code)
