"""Validation: held-out loss and perplexity every `validation.freq` optimizer steps.

Data. A loader of its own, over `validation.dataset_path` or, when that is empty, the last
`validation.holdout_documents` documents of the local training data (which the training loader then
never reads, whether validation is on or not). It is packed like training data (`training.seq_len`,
one virtual shard per sample of a `validation.local_batch_size x dp` batch). Every evaluation starts
from the loader's initial state and reads the same `validation.steps` batches, so successive values
compare the same tokens, and there is no validation state to checkpoint.

Training does not notice it: it reads no training batch, runs the forward under `no_grad` (the
gradients and the optimizer are untouched), and the random-number states are forked and restored
around it (starting a DataLoader iterator draws a seed from torch's generator), so neither that nor a
forward that drew random numbers can shift training. A run with validation trains bitwise like one
without, and resumes as exactly (tests/test_checkpoint_resume.py).

Loss. Each batch's loss comes from the trainer's step runner (`StepRunner.evaluate`): the model call
training makes, inside the same loss scope (`parallelisms/step_context.py`: vocab-parallel logits under
tensor parallelism give a replicated loss), with the training loss function (cross-entropy; a family's
extra training term is left out). Batches hold the
same number of tokens, so their mean is the token mean; it is then averaged over the data-parallel
ranks (tensor-parallel peers read the same batches and hold the same value). Perplexity = exp(loss).
The model stays in training mode (it has no dropout): compiled blocks are traced once more for
`no_grad`, not for a mode switch.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from titanlite.data.loader import TokenLoader, build_dataloader
from titanlite.metrics import ValidationResult
from titanlite.plan import RunPlan
from titanlite.run_loader import data_index_dir
from titanlite.step import StepRunner


def build_validation_loader(plan: RunPlan, dp_rank: int) -> TokenLoader:
    """The held-out loader of data-parallel rank `dp_rank` (built before the process group, as the
    training loader is: bad held-out data is reported before any rank starts work)."""
    t, v = plan.cfg.training, plan.cfg.validation
    return build_dataloader(
        tokenizer=plan.tokenizer,
        dataset_path=v.dataset_path or t.dataset_path,
        text_field=t.dataset_text_field,
        seq_len=t.seq_len,
        local_batch_size=v.local_batch_size,
        global_batch_size=v.local_batch_size * plan.dims.dp,
        dp_rank=dp_rank,
        dp_degree=plan.dims.dp,
        holdout_documents=0 if v.dataset_path else v.holdout_documents,
        heldout=not v.dataset_path,
        index_dir=data_index_dir(plan.cfg),
        report=bool(v.dataset_path),  # the training data's warnings are printed by its own loader
    )


class Validator:
    """Evaluates the model on the held-out batches; `Validator.create` gives None when validation is off."""

    def __init__(self, plan: RunPlan, dp_rank: int) -> None:
        self.plan = plan
        self.cfg = plan.cfg.validation
        self.loader = build_validation_loader(plan, dp_rank)
        self._start = self.loader.state_dict()

    @classmethod
    def create(cls, plan: RunPlan, dp_rank: int) -> Validator | None:
        return cls(plan, dp_rank) if plan.cfg.validation.enable else None

    def due(self, step: int) -> bool:
        return step % self.cfg.freq == 0

    def run(self, runner: StepRunner) -> ValidationResult:
        """The held-out loss of the runner's model, the same on every rank."""
        start, device = time.perf_counter(), runner.device
        total = torch.zeros((), device=device, dtype=torch.float32)
        devices = [device] if device.type == "cuda" else []
        # Inside the fork: a new DataLoader iterator draws its base seed from torch's generator.
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            self.loader.load_state_dict(self._start)  # the same batches at every evaluation
            batches = iter(self.loader)
            for _ in range(self.cfg.steps):
                total += runner.evaluate(next(batches)).float()
        total /= self.cfg.steps
        # The mean over the replicas and, under context parallelism, over each sequence's equal parts.
        for mesh in (self.plan.dims.dp_mesh, self.plan.dims.cp_mesh):
            if mesh is not None:
                dist.all_reduce(total, op=dist.ReduceOp.AVG, group=mesh.get_group())
        tokens = self.cfg.steps * self.cfg.local_batch_size * self.plan.dims.dp * self.plan.cfg.training.seq_len
        return ValidationResult(total.item(), time.perf_counter() - start, tokens)
