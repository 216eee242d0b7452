"""Replica groups under a group's failure, measured from outside as a user meets them.

    scripts/python.sh benchmarks/bench_replica_groups.py [--steps 40] [--at 15] [--repeats 2]
        [--out outputs/bench/replica_groups.json] [-- extra run_train.sh arguments]

Each case is a lighthouse (`titanlite.tools.lighthouse`, heartbeat timeout 2 s) and two replica groups, each one
`run_train.sh` launch of one rank (the debug model, `fault_tolerance.group_size 2`, `min_replica_size 1`), run
`--repeats` times interleaved:

    clean   no fault: the baseline
    kill    once group 1's metrics.jsonl holds `--at` steps, `kill -9` of its rank; its launcher restarts it
            (`comm.max_restarts 1`), it receives group 0's state and rejoins
    away    as kill, but `kill -9` of group 1's whole launch (its launcher too: a lost node), started again by
            hand `--away` seconds later: group 0 trains alone meanwhile

Per case: the exit codes; group 0's steps per second with both groups (the steps before `--at`, the first left
out) and alone (its steps with a quorum of 1 after the first, which holds the failure: `failure_step_s`); its
steps not committed (the step a failure cut short); the steps it trained alone; and the seconds from the kill
(`kill`) or the start by hand (`away`) to group 1's rejoin line and to its first step after the rejoin, and for
`kill` to its launcher's restart line, as they appear in group 1's output.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from replica_groups import start_lighthouse  # noqa: E402  as the tests start it (heartbeat timeout 2 s)

from harness import rank_pid  # noqa: E402  the tests' way of finding a rank from outside


def rows(dump: Path) -> list[dict]:
    path = dump / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        with contextlib.suppress(ValueError):  # the row being written now
            row = json.loads(line)
            if "loss" in row:
                out.append(row)
    return out


def start_group(case: str, k: int, tmp: Path, env: dict, steps: int, extra: list[str], mode: str = "w"):
    """Replica group `k`: one `run_train.sh` of one rank; (process, dump folder, stderr file)."""
    dump, err = tmp / f"{case}-group{k}", tmp / f"{case}-group{k}.err"
    args = ["--training.steps", str(steps), "--metrics.log_freq", "1", "--job.dump_folder", str(dump)]
    args += ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2", "--fault_tolerance.replica_id", str(k)]
    args += ["--comm.max_restarts", "1", *extra]
    proc = subprocess.Popen(
        [str(ROOT / "run_train.sh"), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(err, mode),
        start_new_session=True,
    )
    return proc, dump, err


def watch_rejoin(proc: subprocess.Popen, dump: Path, err: Path, since: float, after: int, marks: dict) -> dict:
    """Seconds from `since` to each of `marks` (name -> text) appearing in `err` after its byte `after`, and to
    the first step logged after the rejoin."""
    times: dict[str, float] = {}
    while proc.poll() is None and len(times) < len(marks) + 1:
        text = err.read_text(errors="replace")[after:]
        for name, mark in marks.items():
            if name not in times and mark in text:
                times[name] = time.monotonic() - since
        if "rejoin_s" in times and "first_step_s" not in times:
            joined = int(text.rsplit("rejoined at step ", 1)[1].split(":")[0])
            if any(r["step"] > joined for r in rows(dump)):
                times["first_step_s"] = time.monotonic() - since
        time.sleep(0.05)
    return times


def run_case(case: str, tmp: Path, steps: int, at: int, away: float, extra: list[str]) -> dict:
    lighthouse = start_lighthouse(tmp)
    env = {**os.environ, "NGPU": "1", "TORCHFT_LIGHTHOUSE": lighthouse.address, "OMP_NUM_THREADS": "1"}
    launches = [start_group(case, k, tmp, env, steps, extra) for k in (0, 1)]
    (g0, dump0, err0), (g1, dump1, err1) = launches
    times: dict[str, float] = {}
    if case in ("kill", "away"):
        while not any(r["step"] >= at for r in rows(dump1)):
            time.sleep(0.1)
        after = len(err1.read_text(errors="replace"))
        if case == "kill":
            os.kill(rank_pid(dump1, 0), signal.SIGKILL)
            marks = {"restart_s": "restarting every rank", "rejoin_s": "rejoined at step"}
        else:
            os.killpg(g1.pid, signal.SIGKILL)
            g1.wait()
            time.sleep(away)
            g1, _, _ = start_group(case, 1, tmp, env, steps, extra, mode="a")
            marks = {"rejoin_s": "rejoined at step"}
        times = watch_rejoin(g1, dump1, err1, time.monotonic(), after, marks)
    codes = [g0.wait(), g1.wait()]
    lighthouse.stop()
    logged = rows(dump0)
    both = [1 / r["step_time_s"] for r in logged if 1 < r["step"] < at and r["ft/quorum_size"] == 2]
    alone_rows = [r for r in logged if r["ft/quorum_size"] == 1 and r["step"] > 1]
    alone = [1 / r["step_time_s"] for r in alone_rows[1:]]
    return {
        "case": case,
        "exit_codes": codes,
        "steps_per_s_both": round(statistics.median(both), 3) if both else None,
        "steps_per_s_alone": round(statistics.median(alone), 3) if alone else None,
        "steps_alone": len(alone_rows),
        "failure_step_s": round(alone_rows[0]["step_time_s"], 2) if alone_rows else None,
        "not_committed": err0.read_text(errors="replace").count("not committed by the replica groups"),
        **{k: round(v, 2) for k, v in times.items()},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--at", type=int, default=15)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--away", type=float, default=10.0, help="away: seconds before group 1 is started again")
    p.add_argument("--out", default="outputs/bench/replica_groups.json")
    p.add_argument("extra", nargs="*", help="after --: more run_train.sh arguments for every group")
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_replica_groups_") as tmp:
        for _ in range(args.repeats):
            for case in ("clean", "kill", "away"):
                results.append(run_case(case, Path(tmp), args.steps, args.at, args.away, args.extra))
                print(json.dumps(results[-1]), flush=True)
                for k in (0, 1):  # the next case starts afresh
                    subprocess.run(["rm", "-rf", str(Path(tmp) / f"{case}-group{k}")], check=True)
    cols = [
        "case",
        "exit_codes",
        "steps_per_s_both",
        "steps_per_s_alone",
        "steps_alone",
        "failure_step_s",
        "not_committed",
        "restart_s",
        "rejoin_s",
        "first_step_s",
    ]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in results:
        print("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
