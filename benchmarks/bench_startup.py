"""Data start-up cost against the data's size: the preflight's data checks and a rank's loader, to its first batch.

    python benchmarks/bench_startup.py [--shards 100,1000,10000] [--documents 10000,100000,1000000]

Each row is one data set made in a temporary folder: a pre-tokenized folder of that many tiny shards (2
documents each, written by the tokenize tool), or one `.txt` file of that many tiny documents. Columns,
each timed once, as the shipped functions run them (`titanlite/launcher/preflight.py`'s `check_data`,
`titanlite/run/loader.py`'s `build_loader`), with the debug model's config and a world of 2:

- preflight cold: the node's first check (indexes the text; reads and verifies every shard);
- preflight warm: the next launch's check of the unchanged data;
- rank set-up: one rank's training loader built after the preflight (`report=False`, as under the launcher),
  and the file opens and stats that made (Python's `open`, `os.open`, `os.stat`);
- first batch: that loader's first batch (reading its documents);
- pickled into a worker: what each loader worker of that rank receives (its dataset, pickled), in bytes.
"""

from __future__ import annotations

import argparse
import builtins
import io
import os
import pickle
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titanlite.config import DEFAULT_CONFIG, load_config  # noqa: E402
from titanlite.launcher.preflight import check_data  # noqa: E402
from titanlite.planning.run_plan import RunPlan  # noqa: E402
from titanlite.run.loader import build_loader  # noqa: E402
from titanlite.tools.tokenize import tokenize_source  # noqa: E402

WORLD_SIZE = 2


@contextmanager
def counting(calls: list[str]) -> Iterator[None]:
    """Every file open and stat of this process (Python's), appended to `calls` by path."""
    saved = builtins.open, io.open, os.open, os.stat

    def wrap(real: Callable) -> Callable:
        def counted(path, *args, **kwargs):
            calls.append(os.fspath(path) if isinstance(path, (str, bytes, os.PathLike)) else str(path))
            return real(path, *args, **kwargs)

        return counted

    builtins.open, io.open, os.open, os.stat = (wrap(f) for f in saved)
    try:
        yield
    finally:
        builtins.open, io.open, os.open, os.stat = saved


def text(path: Path, documents: int) -> Path:
    """`documents` tiny documents (a few words each) in one .txt file."""
    with open(path, "w") as f:
        for i in range(documents):
            f.write(f"document {i} has a few words\n\n")
    return path


def measure(dataset_path: str, dump: Path) -> tuple[list[float], int, int]:
    """([preflight cold s, preflight warm s, rank set-up s, first batch s], rank set-up's opens + stats,
    pickled dataset bytes)."""
    argv = ["--training.dataset_path", dataset_path, "--job.dump_folder", str(dump)]
    plan = RunPlan.build(load_config(argv, default_config=DEFAULT_CONFIG), WORLD_SIZE)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        check_data(plan)
        times.append(time.perf_counter() - start)
    calls: list[str] = []
    with counting(calls):
        start = time.perf_counter()
        loader = build_loader(plan, dp_rank=1, report=False)
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    next(iter(loader))
    times.append(time.perf_counter() - start)
    return times, len(calls), len(pickle.dumps(loader.dataset))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", default="100,1000,10000")
    parser.add_argument("--documents", default="10000,100000,1000000")
    args = parser.parse_args(argv)
    cases: list[tuple[str, Callable[[Path], str]]] = []
    for n in [int(s) for s in args.shards.split(",") if s]:

        def tokens(tmp: Path, n: int = n) -> str:
            source = text(tmp / "docs.txt", 2 * n)
            tokenize_source(str(source), "text", "", tmp / "tokens", workers=1, per_shard=2)
            return str(tmp / "tokens")

        cases.append((f"{n:,} shards", tokens))
    for n in [int(s) for s in args.documents.split(",") if s]:
        cases.append((f"{n:,} text documents", lambda tmp, n=n: str(text(tmp / "docs.txt", n))))
    columns = ["preflight cold", "preflight warm", "rank set-up", "first batch", "rank set-up opens + stats"]
    print(f"| data | {' | '.join(columns)} | pickled into a worker |")
    print("|---|---|---|---|---|---|---|")
    for name, make in cases:
        with tempfile.TemporaryDirectory() as tmp:
            path = make(Path(tmp))
            times, calls, size = measure(path, Path(tmp) / "dump")
            cells = [f"{s * 1000:,.0f} ms" for s in times]
            print(f"| {name} | {' | '.join(cells)} | {calls:,} | {size:,} B |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
