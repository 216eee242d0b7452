"""The training entry point: `python -m titanlite.train --config FILE [--section.key value ...]`.

Under `titanlite.launch` (`run_train.sh`), under torchrun or alone: a single process is a world of one
and gets the same plan. The data path reads top to bottom: config -> RunPlan (`build.py`) -> device and
process group -> model (meta -> parallelize -> init) -> optimizer, LR schedule, dataloader ->
`train_step` in the loop -> metrics and checkpoints. Bad input is one line and exit code 2, divergence
exit code 3; Ctrl-C saves and stops, twice stops at once with exit code 130 (`resilience.run_rank`).
Under `titanlite.launch` a failing rank's message goes to the launcher, which prints it once. Nothing
imports this module: the Trainer is `titanlite.trainer`, tools build runs through `titanlite.build`.
"""

from __future__ import annotations

import sys

from titanlite.build import world_from_env
from titanlite.config import DEFAULT_CONFIG, help_requested, help_text, load_config
from titanlite.resilience import Preemption, note_failure, run_rank
from titanlite.trainer import Trainer


def main(argv: list[str]) -> int:
    if help_requested(argv):
        print(help_text())
        return 0
    preemption = Preemption(interrupt=True)
    cfg = load_config(argv, default_config=DEFAULT_CONFIG)
    if cfg.job.print_config:  # the merged config, without training
        if world_from_env()[0] == 0:
            print(cfg.to_json(), flush=True)
        return 0
    trainer = Trainer(cfg, preemption=preemption)
    try:
        trainer.train()
    except BaseException as e:
        note_failure(e)
        raise
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(run_rank(main))
