"""Float8 training as a user meets it: run_train.sh with float8 on two ranks, its checkpoints resumed in
float8 (exactly) and in float32, and exported to Hugging Face. Its numerics against a one-process
reference are in test_parallel_parity.py; its refusals in test_bad_input.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness import (
    ROOT,
    SMALL,
    assert_resumed,
    child_env,
    copy_checkpoint,
    step_metric,
    train,
    train_in_one_launch,
)

# The debug model's layers are below the automatic filter's sizes (made for H100s): name-filtered only.
FLOAT8 = ["--float8.enable", "--float8.emulate", "--float8.recipe", "rowwise", "--float8.filter_fqns", "output"]
RUN = [*SMALL, "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "2"]


@pytest.mark.slow
def test_a_float8_run_resumes_exactly_resumes_in_float32_and_exports(tmp_path):
    first = train(tmp_path / "float8", 2, *RUN, *FLOAT8, launcher="run_train").ok()
    assert "float8 rowwise (emulated): 42 of 43 linear layers" in first.stderr
    again, plain = tmp_path / "again", tmp_path / "plain"
    for dst in (again, plain):
        copy_checkpoint(first.dump, dst, 2)
    runs = train_in_one_launch([(again, [*RUN, *FLOAT8]), (plain, RUN)], 2)
    for dst in (again, plain):
        assert_resumed(runs[dst], 2)
    losses = step_metric(first.dump)
    # Float8 again: steps 3 and 4 exactly as the uninterrupted run; float32: the same weights, other numerics.
    assert step_metric(again) == {s: losses[s] for s in (3, 4)}
    resumed = step_metric(plain)
    assert set(resumed) == {3, 4} and all(0 < abs(resumed[s] - losses[s]) / losses[s] < 1e-2 for s in (3, 4))
    # The checkpoint holds the master weights under their usual names: the export is a plain Llama.
    out = tmp_path / "hf"
    cli = [sys.executable, "-m", "titanlite.tools.hf", "export", "--config", "train_configs/debug_model.toml"]
    export = [*cli, "--job.dump_folder", str(first.dump), "--out", str(out), *FLOAT8]
    proc = subprocess.run(export, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    assert torch.isfinite(hf(torch.tensor([[1, 2, 3]])).logits).all()
