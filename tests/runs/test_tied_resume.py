"""A tied model (Qwen3 `debugmodel_tied`: the output projection's weight is the embedding's, one Parameter
under two FQNs) saved and resumed through the trainer under sharded layouts.

One 2-rank launch trains 4 steps on SimpleFSDP (dp 2) with a checkpoint at step 2, then resumes that
step-2 checkpoint on SimpleFSDP (same layout: steps 3-4 bitwise equal to the uninterrupted run) and on
FSDP2 (dp 2); one process resumes it too (world 2 -> 1). Another layout changes only the order of
floating-point reductions: within `LOSS_REL` (observed: 6.4e-8 on FSDP2, 6.3e-8 on one process).

The tie survives a load: the checkpoint stores the tied weight under both FQNs (its AdamW state once);
two steps after each resume the saved `output.weight` still equals the embedding's bitwise, which a resume
that loaded them into two Parameters would not keep (they get different gradients, or one none).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from harness import (
    LOSS_REL,
    SHALLOW,
    SMALL,
    assert_resumed,
    copy_checkpoint,
    max_rel,
    step_metric,
    train,
    train_in_one_launch,
)

pytestmark = pytest.mark.slow

TIED = ["--model.name", "qwen3", "--model.flavor", "debugmodel_tied"]
RUN = [*SMALL, *SHALLOW, *TIED, "--training.steps", "4", "--training.global_batch_size", "4"]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "2"]


TIED_FQNS = ("tok_embeddings.weight", "output.weight")


def assert_tied(step_dir: Path) -> None:
    """Checkpoint `step_dir` stores the tied weight under both FQNs, equal bitwise, and its AdamW state once
    (torch's optimizer state dict names a shared parameter by one of its FQNs)."""
    metadata = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    state = {}
    for key in TIED_FQNS:
        meta = metadata[key]
        assert isinstance(meta, TensorStorageMetadata), key
        state[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    with warnings.catch_warnings():  # DCP warns that it loads in one process, as asked
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(step_dir), no_dist=True)
    assert torch.equal(*state.values()), f"{step_dir}: output.weight differs from tok_embeddings.weight"
    moments = {k for k in metadata if k.startswith("optimizer.state.") and any(f in k for f in TIED_FQNS)}
    assert len({next(f for f in TIED_FQNS if f in k) for k in moments}) == 1, sorted(moments)


def test_tied_model_resumes_on_sharded_layouts(tmp_path):
    reference = tmp_path / "reference"
    same, fsdp2, single = tmp_path / "simple_fsdp", tmp_path / "fsdp2", tmp_path / "single"
    step2 = reference / "checkpoint" / "step-2"
    runs = [
        (reference, [*RUN, *CKPT]),
        (same, [*RUN, *CKPT]),
        (fsdp2, [*RUN, *CKPT, "--parallelism.dp_impl", "fsdp2"]),
    ]
    results = train_in_one_launch(runs, 2, copy_before={same: step2, fsdp2: step2})
    one = train(copy_checkpoint(reference, single, 2), 1, *RUN, *CKPT).ok()

    for dump in (reference, same, fsdp2, single):
        assert_tied(dump / "checkpoint" / "step-4")
    expected = step_metric(reference)
    assert sorted(expected) == [1, 2, 3, 4]
    after = {s: v for s, v in expected.items() if s > 2}
    for dump, result in [*results.items(), (single, one)]:
        if dump == reference:
            continue
        assert_resumed(result, 2)
        got = step_metric(dump)
        assert sorted(got) == [3, 4], (dump.name, got)
        if dump == same:
            assert got == after, (got, after)
        else:
            assert max_rel(got, after) <= LOSS_REL, (dump.name, got, after)
