"""A run under the faults a cluster causes, measured from outside the ranks as a user meets them.

    scripts/python.sh benchmarks/bench_chaos.py [--steps 40] [--at 18] [--cases clean,kill,hang,slow,kill_cold]
        [--out outputs/bench/chaos.json] [-- extra run_train.sh arguments]

Each case is one `run_train.sh` launch of 2 ranks (the debug model cut to 2 blocks, 64-token sequences, a
durable checkpoint every 10 steps and a node-local one every 3, `comm.max_restarts 1`,
`comm.hang_timeout_seconds 10`, compiled blocks) in a dump folder of its own, with one fault injected from
outside once metrics.jsonl holds `--at` steps:

    clean       none: the baseline
    kill        `kill -9` of rank 1: the launcher restarts every rank from the newest checkpoint
    hang        `kill -STOP` of rank 1: the hang watchdog names it, writes the stacks, restarts
    slow        rank 1 stopped for two thirds of every half second until the run ends (no restart)
    kill_cold   `kill -9` as above, with the compile cache emptied before the restart: a restart that
                compiles again (a cache on a node that is gone), against `kill`'s warm one

Per case: exit code, wall seconds, goodput and the two largest badput categories (the job's goodput line),
steps trained more than once (lost to the failure), detection seconds (from the fault to the launcher's
restart line) and restart seconds (from that line to the first step of the restarted ranks, both seen in
the launch's output and metrics.jsonl as they appear), and for `slow` the rank the straggler line names.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from harness import rank_pid  # noqa: E402  the tests' way of finding a rank from outside

CASES = ("clean", "kill", "hang", "slow", "kill_cold")
GOODPUT = re.compile(r"^goodput (\d+\.\d)% of (\d+) s: (.*) \(ledger", re.MULTILINE)
STRAGGLER = re.compile(r"straggler at step (\d+): rank (\d+)")


def rows(dump: Path) -> list[dict]:
    path = dump / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    out = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):  # the row rank 0 is writing now
            out.append(json.loads(line))
    return out


def watch(case: str, proc: subprocess.Popen, dump: Path, cache: Path, err_path: Path, at: int) -> tuple:
    """Inject `case`'s fault once metrics.jsonl holds `at` steps; (fault, detected, restarted) times."""
    pid, fault_at, detected, restarted = None, None, None, None
    while proc.poll() is None:
        pid = pid or rank_pid(dump, 1)
        seen = rows(dump)
        if fault_at is None and case != "clean" and pid and len(seen) >= at:
            fault_at = time.monotonic()
            if case.startswith("kill"):
                os.kill(pid, signal.SIGKILL)
            elif case == "hang":
                os.kill(pid, signal.SIGSTOP)
        if case == "slow" and fault_at is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                time.sleep(1 / 3)
                os.kill(pid, signal.SIGCONT)
            time.sleep(1 / 6)
            continue
        if fault_at is not None and detected is None and "restarting every rank" in err_path.read_text():
            detected = time.monotonic()
            if case == "kill_cold":
                shutil.rmtree(cache, ignore_errors=True)
        if detected is not None and restarted is None and any(r.get("run") == 2 for r in seen):
            restarted = time.monotonic()
        time.sleep(0.02)
    return fault_at, detected, restarted


def run_case(case: str, args: argparse.Namespace, root: Path) -> dict:
    dump = root / case
    cache = root / f"{case}-inductor"
    env = {**os.environ, "NGPU": "2", "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    cmd = [str(ROOT / "run_train.sh"), "--job.dump_folder", str(dump), "--training.steps", str(args.steps)]
    cmd += ["--model.n_layers", "2", "--training.seq_len", "64", "--training.local_batch_size", "2"]
    cmd += ["--metrics.log_freq", "1", "--no-metrics.enable_tensorboard", "--training.deterministic"]
    cmd += ["--checkpoint.enable", "--checkpoint.interval", "10", "--checkpoint.local_interval", "3"]
    cmd += ["--checkpoint.local_folder", str(root / f"{case}-local"), "--comm.max_restarts", "1"]
    cmd += ["--comm.hang_timeout_seconds", "10", "--compile.enable", *args.extra]
    err_path = root / f"{case}.err"
    started = time.monotonic()
    with open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        fault_at, detected, restarted = watch(case, proc, dump, cache, err_path, args.at)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    wall = time.monotonic() - started
    stderr = err_path.read_text()
    trained = [r["step"] for r in rows(dump) if "loss" in r]
    goodput = GOODPUT.search(stderr)
    badput = (
        sorted(((float(s), name) for name, s in re.findall(r"(\w+) (\d+\.\d) s", goodput[3])), reverse=True)
        if goodput
        else []
    )
    named = STRAGGLER.search(stderr)
    return {
        "case": case,
        "exit": proc.returncode,
        "wall_s": round(wall, 1),
        "goodput_pct": float(goodput[1]) if goodput else None,
        "largest_badput": ", ".join(f"{name} {s:.1f} s" for s, name in badput[:2]),
        "lost_steps": len(trained) - len(set(trained)),
        "detect_s": round(detected - fault_at, 1) if detected and fault_at else None,
        "restart_s": round(restarted - detected, 1) if restarted and detected else None,
        "straggler": f"rank {named[2]} at step {named[1]}" if named else "",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--at", type=int, default=18, help="inject the fault once metrics.jsonl holds this many steps")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--out", default="outputs/bench/chaos.json")
    parser.add_argument("extra", nargs="*", help="more run_train.sh arguments, after --")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="titanlite-chaos-") as tmp:
        for case in args.cases.split(","):
            result = run_case(case, args, Path(tmp))
            print(json.dumps(result), flush=True)
            results.append(result)
    columns = ("case", "exit", "wall_s", "goodput_pct", "largest_badput", "lost_steps", "detect_s", "restart_s")
    print("| " + " | ".join((*columns, "straggler")) + " |")
    print("|" + "---|" * (len(columns) + 1))
    for r in results:
        print("| " + " | ".join("-" if r[c] in (None, "") else str(r[c]) for c in (*columns, "straggler")) + " |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
