"""The model seam: a family registered outside titanlite (tests/workers/mlp_lm.py, an MLP language
model with its own parallelize plan) trains on 2 ranks through the unchanged trainer, saves a
checkpoint and resumes from it."""

from __future__ import annotations

import re

import pytest

from harness import SMALL, assert_ok, torchrun
from titanlite.checkpoint import folders

pytestmark = pytest.mark.slow


def test_a_second_model_family_trains_checkpoints_and_resumes(tmp_path):
    def run(steps: int):
        return torchrun(
            [
                "tests/workers/mlp_lm.py",
                "--model.name",
                "mlp_lm",
                "--model.flavor",
                "tiny",
                "--job.dump_folder",
                str(tmp_path),
                *SMALL,
                "--training.steps",
                str(steps),
                "--training.local_batch_size",
                "2",
                "--checkpoint.enable",
                "--checkpoint.interval",
                "3",
            ],
            2,
        )

    first = run(3)
    assert_ok(first)
    assert "model mlp_lm tiny" in first.stderr
    assert folders.scan(tmp_path / "checkpoint") == ([3], [])
    second = run(5)
    assert_ok(second)
    assert "resumed from" in second.stderr and "step-3 at step 3" in second.stderr
    assert folders.scan(tmp_path / "checkpoint") == ([3, 5], [])
    steps = [int(m.group(1)) for m in re.finditer(r"rank0\].* step +(\d+)/5 ", second.stderr)]
    assert steps == [4, 5]
