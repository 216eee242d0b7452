"""Validation: the held-out split, the value of an evaluation, and that training does not notice it.

In-process on the tiny model; the launched runs (validation under dp2 and dp2 x tp2, exact resume with
validation, training bitwise unchanged by it) are in test_checkpoint_resume.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from harness import SMALL, tiny_args, train
from titanlite.config import load_config
from titanlite.data.loader import build_dataloader
from titanlite.data.tokenizer import build_tokenizer
from titanlite.errors import ConfigError
from titanlite.parallelisms.step_context import StepContext
from titanlite.planning.run_plan import RunPlan
from titanlite.run.build import build_model
from titanlite.run.loader import build_validation_loader
from titanlite.run.step import LocalRunner, cross_entropy_loss
from titanlite.run.validation import Validator

TOK = build_tokenizer(None)
DOCS = [f"Document {i}: " + " ".join(["held", "out", "text", str(i)] * (i % 7 + 1)) for i in range(40)]


class SpyTokenizer:
    """The bundled tokenizer, recording which documents it was given."""

    def __init__(self) -> None:
        self.seen: set[int] = set()

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        self.seen.add(DOCS.index(text))
        return TOK.encode(text, bos=bos, eos=eos)


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    return path


def _read_all(data: Path, *, heldout: bool, holdout: int) -> set[int]:
    spy = SpyTokenizer()
    dl = build_dataloader(
        tokenizer=spy,
        dataset_path=str(data),
        text_field="text",
        seq_len=16,
        local_batch_size=4,
        global_batch_size=4,
        dp_rank=0,
        dp_degree=1,
        holdout_documents=holdout,
        heldout=heldout,
    )
    batches = iter(dl)
    for _ in range(60):  # several passes over either part
        next(batches)
    return spy.seen


def test_held_out_documents_are_never_trained_on(data):
    assert _read_all(data, heldout=False, holdout=10) == set(range(30))
    assert _read_all(data, heldout=True, holdout=10) == set(range(30, 40))
    assert _read_all(data, heldout=False, holdout=0) == set(range(40))  # negative control: no hold-out


def _plan(data: Path, tmp_path: Path) -> RunPlan:
    cfg = load_config(
        [
            "--job.dump_folder",
            str(tmp_path),
            "--training.dataset_path",
            str(data),
            "--training.seq_len",
            "16",
            "--validation.enable",
            "--validation.holdout_documents",
            "12",
            "--validation.steps",
            "3",
            "--validation.local_batch_size",
            "2",
        ]
    )
    return RunPlan.build(cfg, 1, args=tiny_args(vocab_size=TOK.n_words))


def test_validation_loss_is_the_mean_cross_entropy_and_leaves_training_untouched(process_group, data, tmp_path):
    plan = _plan(data, tmp_path)
    model = build_model(plan, torch.device("cpu"))
    validator = Validator.create(plan, dp_rank=0)
    runner = LocalRunner(model, torch.device("cpu"), StepContext(cross_entropy_loss))
    rng = torch.get_rng_state()
    first = validator.run(runner)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())

    # The reference: the same held-out batches, through the model by hand.
    batches = iter(build_validation_loader(plan, dp_rank=0))
    with torch.no_grad():
        held_out = [next(batches) for _ in range(3)]
        losses = [F.cross_entropy(model(b.inputs).flatten(0, 1).float(), b.labels.flatten()) for b in held_out]
    expected = torch.stack(losses).mean().item()
    assert first.loss == pytest.approx(expected, rel=1e-6)
    assert first.perplexity == pytest.approx(math.exp(expected), rel=1e-6)
    assert first.tokens == 3 * 2 * 16
    assert validator.run(runner).loss == first.loss  # same batches each time

    with torch.no_grad():  # negative control: another model gives another loss
        dict(model.named_parameters())["output.weight"].mul_(2.0)
    assert validator.run(runner).loss != first.loss


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--validation.enable"], "needs held-out data"),
        (
            ["--validation.dataset_path", "v.jsonl", "--validation.holdout_documents", "5"],
            "exclude each other",
        ),
        (
            ["--training.dataset_path", "hf://c4:en", "--validation.holdout_documents", "5"],
            "hf://name\\[:config\\]@validation",
        ),
        (["--validation.freq", "0"], "validation.freq' must be positive"),
        (
            [
                "--validation.enable",
                "--validation.holdout_documents",
                "5",
                "--parallelism.pipeline_parallel_degree",
                "2",
            ],
            "not supported with pipeline_parallel_degree > 1",
        ),
    ],
)
def test_bad_validation_settings_are_config_errors(args, message):
    """Each key alone is checked by the loader, the rules between keys by the run plan (the preflight)."""
    with pytest.raises(ConfigError, match=message):
        RunPlan.build(load_config(args), 2)


@pytest.mark.slow
def test_held_out_data_smaller_than_one_evaluation_is_said_once(tmp_path, data):
    """Through run_train.sh: 4 held-out documents, far fewer tokens than an evaluation of 10 batches reads.
    Every evaluation reads them again from their start (each repeats documents); that is one warning in
    the run, and no `data: epoch` line at any evaluation."""
    result = train(
        tmp_path / "dump",
        1,
        *SMALL,
        "--training.dataset_path",
        str(data),
        "--training.steps",
        "2",
        "--validation.enable",
        "--validation.holdout_documents",
        "4",
        "--validation.local_batch_size",
        "2",
        "--validation.freq",
        "1",
        launcher="run_train",
    ).ok()
    assert [r["step"] for r in result.metrics if "val_loss" in r] == [1, 2]
    warned = [line for line in result.log.splitlines() if "validation: the held-out data is smaller" in line]
    assert len(warned) == 1 and "up to " in warned[0], result.log[-3000:]
    assert "data: epoch" not in result.log, result.log[-3000:]
