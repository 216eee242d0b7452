"""End to end through the trainer's CLI: one process as a first-class run (the full plan, with or
without torchrun, equal to 2 processes, whose metrics and TensorBoard events are checked), and the
preflight's one-line refusals.

Layout parity through the command line is checked where a layout's own runs are: dp2 x tp2, FSDP2 (dp4)
and pipeline stages (pp2 x dp2) resumed from a dp2 checkpoint in tests/runs/test_checkpoint_resume.py (within
1e-5 of the uninterrupted dp2 run), cp2 and cp2 x dp_shard2 against one process in
tests/unit/parallelisms/test_context_parallel.py; every layout through the trainer's step in
tests/runs/test_parallel_parity.py.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harness import LOSS_REL, SHALLOW, SMALL, preflight
from harness import train as run_trainer
from titanlite.tools.dashboard import read_dashboard

# aot_eager keeps the three compiles short; the inductor backend's parity is in test_compile.
# fmt: off
FULL_PLAN = ["--training.steps", "8", "--training.global_batch_size", "8", "--compile.enable",
             "--compile.backend", "aot_eager", "--activation_checkpoint.mode", "selective",
             "--model.attn_mask_type", "block_causal"]
# fmt: on


@pytest.mark.slow
def test_one_process_gets_the_full_plan_and_matches_two(tmp_path):
    """One process (run_train.sh with NGPU=1, and python -m titanlite.train without torchrun) compiles,
    checkpoints activations, masks packed documents apart (block_causal) and writes the compile report;
    its losses equal 2 processes' at the same global batch (fp32, deterministic). The 2-process run also
    writes metrics.jsonl and TensorBoard events that hold the same values."""
    # The three runs go side by side: their compiles are mostly single-threaded Python.
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "OMP_NUM_THREADS": "1"}
    launches = {
        "python": (1, "8", "python", []),
        "ngpu1": (1, "8", "run_train", []),
        "ngpu2": (2, "4", "run_train", ["--metrics.enable_tensorboard"]),
    }
    with ThreadPoolExecutor(len(launches)) as pool:
        futures = {
            name: pool.submit(
                run_trainer,
                tmp_path / name,
                nproc,
                *SMALL,
                *SHALLOW,
                *FULL_PLAN,
                "--training.local_batch_size",
                local,
                *extra,
                launcher=launcher,
                env=env,
            )
            for name, (nproc, local, launcher, extra) in launches.items()
        }
        runs = {name: future.result() for name, future in futures.items()}
    for name, run in runs.items():
        run.ok()
        assert "plan: AC selective (op); compile aot_eager" in run.log, name
        assert "; attention block_causal (packed documents masked apart)" in run.log, name
        report = json.loads((run.dump / "compile_report.json").read_text())
        assert report["backend"] == "aot_eager" and report["units"] == report["n_blocks"] > 0, (name, report)
        # The first step compiles: its time says nothing of the steps left, so the first line has no ETA.
        steps = [line for line in run.log.splitlines() if " INFO step " in line]
        assert len(steps) == 8 and steps[0].endswith("  eta n/a (the first step compiles)"), (name, steps[0])
        assert all(re.search(r"  eta \d+:\d\d:\d\d$", line) for line in steps[1:]), (name, steps)
    assert "mesh {'dp_shard': 1} (simple_fsdp, fully_shard)" in runs["python"].log
    reference = runs["ngpu2"].losses
    for name in ("python", "ngpu1"):
        losses = runs[name].losses
        diffs = [abs(a - b) / abs(b) for a, b in zip(losses, reference)]
        assert len(diffs) == 8 and max(diffs) < LOSS_REL, (name, diffs)
    check_metrics_and_tensorboard(runs["ngpu2"].metrics, runs["ngpu2"].dump / "tb")
    # The run's TensorBoard folder says what tells it from the dump folder's other runs, as the log does.
    assert [p.name for p in (runs["ngpu2"].dump / "tb").iterdir()] == ["run001-dp_shard2-compile"]
    assert "(run 1 in this file: run001-dp_shard2-compile, listed in runs.jsonl)" in runs["ngpu2"].log


def check_metrics_and_tensorboard(records: list[dict], tb: Path) -> None:
    """Every step has a metrics.jsonl row with every key, and TensorBoard holds the same losses."""
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    for key in ("step", "loss", "grad_norm", "lr", "tps", "tflops", "mfu_pct", "mem_peak_gib", "data_pct"):
        assert key in records[0], key
    assert records[-1]["loss"] < records[0]["loss"]
    assert all(r["tps"] > 0 and r["mem_peak_gib"] > 0 for r in records)

    run_dirs = list(tb.iterdir())
    assert len(run_dirs) == 1
    # As TensorBoard's server reads it: every logged tag is in the custom layout, with its display name.
    board = read_dashboard(str(run_dirs[0]))
    tags = set(board.scalars)
    assert {
        "loss/loss",
        "loss/grad_norm",
        "loss/lr",
        "throughput/tps",
        "throughput/mfu_pct",
        "memory/mem_peak_gib",
        "time/data_pct",
    } <= tags
    losses = [value for _, value in board.scalars["loss/loss"].values]
    assert losses == pytest.approx([r["loss"] for r in records], rel=1e-6)
    in_layout = {t for charts in board.layout.values() for tags in charts.values() for t in tags}
    assert in_layout == set(board.scalars) == tags
    assert board.scalars["throughput/tps"].display_name == "Throughput (tokens/s per GPU)"


@pytest.mark.slow
def test_bad_dataset_path_is_one_line(tmp_path):
    proc = preflight(
        "--config",
        "train_configs/debug_model.toml",
        "--training.dataset_path",
        str(tmp_path / "nothing*.jsonl"),
        world=2,
    )
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "nothing" in proc.stderr


@pytest.mark.slow
def test_preflight_reports_bad_mesh(tmp_path):
    proc = preflight(
        "--config",
        "train_configs/debug_model.toml",
        "--parallelism.data_parallel_shard_degree",
        "3",
        "--job.dump_folder",
        str(tmp_path),
        world=4,
    )
    assert proc.returncode == 2
    assert "dp_shard=3" in proc.stderr and "world size 4" in proc.stderr
    assert "Traceback" not in proc.stderr
