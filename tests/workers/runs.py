"""Several trainer runs in one launch: each is `titanlite.train.main(argv)`, the function
`python -m titanlite.train argv` runs, one after another in the same processes.

`tests/workers/runs.py RUNS.json` on N ranks (`harness.train_in_one_launch`, through `launch_workers`),
where RUNS.json is a list of {"dump": folder, "argv": [...]} runs (the folder is the argv's dump folder); a run
with "copy": [src, dst] first has rank 0 copy the checkpoint folder `src` (of an earlier run of the
launch) to `dst` (in its own dump folder), where it resumes from it. The process group is created once;
each run's trainer uses it and leaves it open (`Trainer.close`), so a run costs its build and its steps,
not the seconds of interpreter start-up, `import torch` and rendezvous that a launch of its own costs
every rank. Each rank's output during a run goes to `<dump_folder>/worker.rank<r>.log`. A run that
raises ends the launch with its traceback, as a rank of its own would.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness import end_worker  # noqa: E402
from titanlite.train import main as train  # noqa: E402


def main() -> None:
    runs: list[dict] = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for run in runs:
        argv, dump = run["argv"], Path(run["dump"])
        dump.mkdir(parents=True, exist_ok=True)
        if "copy" in run and rank == 0:
            shutil.copytree(*run["copy"])
        dist.barrier()
        torch._dynamo.reset()  # a compiled run starts from an empty cache, as in a process of its own
        with open(dump / f"worker.rank{rank}.log", "w") as out:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                assert train(argv) == 0
        dist.barrier()
    end_worker()


if __name__ == "__main__":
    main()
