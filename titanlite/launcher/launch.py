"""The launcher: `python -m titanlite.launcher.launch [torchrun options] -m titanlite.train [--config FILE ...]`.

It takes torchrun's command line and runs torch's elastic agent (`agent.py`) to start, watch and restart
the ranks of this node, as a scheduler and a terminal expect of a job's first process. Its first
instruction is the stop-signal recorder; then the training config is read and checked without torch (a
mistyped key is one line within a second); only then come `import torch`, the preflight and the agent.
SIGTERM, SIGUSR1 and the first Ctrl-C are forwarded once to every rank, which save and exit at the next
step (a second Ctrl-C kills them, exit code 130); every rank dies with the launcher
(`rank_exit.follow_launcher`); a failing rank's root cause is printed once, with its exit code (2 bad
input, 3 divergence, 4 work not saved, 1 a crash). docs/failure_handling.md has every case.
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
