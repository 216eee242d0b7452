"""The training entry point: `python -m titanlite.train --config FILE [--section.key value ...]`.

Under `titanlite.launcher.launch` (`run_train.sh`), under torchrun or alone: a single process is a world
of one and gets the same plan. It builds a `titanlite.run.trainer.Trainer`, trains and closes it; bad
input is one line and exit code 2, divergence exit code 3, work that could not be saved exit code 4;
Ctrl-C saves and stops, twice stops at once with exit code 130 (`rank_exit.run_rank`). Nothing imports
this module. The stop-signal recorder is the first thing a rank does, before the seconds of
`import torch` the trainer needs, so a signal that arrives while the rank starts is never lost
(`run/signals.py`).
"""

from __future__ import annotations

from titanlite.errors import exit_now
from titanlite.run.signals import Preemption


def main(argv: list[str], preemption: Preemption | None = None) -> int:
    """Train; `preemption` is the recorder installed at start-up (one is installed now without it)."""
    preemption = preemption or Preemption(interrupt=True)
    from titanlite.config import DEFAULT_CONFIG, help_requested, help_text, load_config
    from titanlite.run.build import world_from_env
    from titanlite.run.rank_exit import note_failure
    from titanlite.run.trainer import Trainer

    if help_requested(argv):
        print(help_text())
        return 0
    cfg = load_config(argv, default_config=DEFAULT_CONFIG)
    if cfg.job.print_config:  # the merged config, without training
        if world_from_env()[0] == 0:
            print(cfg.to_json(), flush=True)
        return 0
    trainer = Trainer(cfg, preemption=preemption)
    try:
        trainer.train()
    except BaseException as e:
        trainer.goodput.mark("restart")  # the failing step or phase: time the failure cost
        note_failure(e)
        raise
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    stop = Preemption(interrupt=True)
    from titanlite.run.rank_exit import run_rank  # after the recorder

    exit_now(run_rank(lambda argv: main(argv, stop)))
