"""End to end through the trainer's CLI: a short 2-process run, its metrics, TensorBoard events, and
layout parity through the command line (the same global batch on 1 process and on a 4-process mesh)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness import ROOT, assert_ok, child_env, torchrun

SMALL = ["--training.seq_len", "64", "--metrics.log_freq", "1", "--training.deterministic"]


def train(tmp: Path, nproc: int, *overrides: str) -> list[dict]:
    dump = tmp / "dump"
    proc = torchrun(["-m", "titanlite.train", "--config", "train_configs/debug_model.toml",
                     "--job.dump_folder", str(dump), *SMALL, *overrides], nproc)
    assert_ok(proc)
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_process_run_writes_metrics_and_tensorboard(tmp_path):
    records = train(tmp_path, 2, "--training.steps", "6")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for key in ("step", "loss", "grad_norm", "lr", "tps", "tflops", "mfu", "mem_peak_gib", "data_time_pct"):
        assert key in records[0], key
    assert records[-1]["loss"] < records[0]["loss"]
    assert all(r["tps"] > 0 and r["mem_peak_gib"] > 0 for r in records)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dirs = list((tmp_path / "dump" / "tb").iterdir())
    assert len(run_dirs) == 1
    acc = EventAccumulator(str(run_dirs[0]))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss/loss", "loss/grad_norm", "loss/lr", "throughput/tps", "throughput/mfu_pct",
            "memory/peak_gib", "time/data_pct"} <= tags
    losses = [e.value for e in acc.Scalars("loss/loss")]
    assert losses == pytest.approx([r["loss"] for r in records], rel=1e-6)


PARITY_STEPS = ["--training.steps", "10", "--training.global_batch_size", "8"]


@pytest.fixture(scope="module")
def one_process_reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("ref"), 1, *PARITY_STEPS, "--training.local_batch_size", "8")


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"],
    ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
     "--training.local_batch_size", "2"],
    ["--parallelism.dp_impl", "fsdp2", "--parallelism.data_parallel_shard_degree", "4",
     "--training.local_batch_size", "2"],
], ids=["dp2xtp2", "hsdp2x2", "fsdp2"])
def test_cli_layout_parity_with_one_process(tmp_path, layout, one_process_reference):
    """Same global batch of 8: one process with local batch 8 vs 4 processes; losses match (fp32)."""
    par = train(tmp_path, 4, *PARITY_STEPS, "--training.local_batch_size", "4", *layout)
    diffs = [abs(a["loss"] - b["loss"]) / a["loss"] for a, b in zip(one_process_reference, par)]
    assert len(diffs) == 10 and max(diffs) < 1e-5, diffs


def test_bad_dataset_path_is_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "titanlite.preflight", "--config", "train_configs/debug_model.toml",
         "--training.dataset_path", str(tmp_path / "nothing*.jsonl")],
        env=child_env(WORLD_SIZE="2"), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "nothing" in proc.stderr


def test_preflight_reports_bad_mesh(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "titanlite.preflight", "--config", "train_configs/debug_model.toml",
         "--parallelism.data_parallel_shard_degree", "3", "--job.dump_folder", str(tmp_path)],
        env=child_env(WORLD_SIZE="4"), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "dp_shard=3" in proc.stderr and "world size 4" in proc.stderr
    assert "Traceback" not in proc.stderr
