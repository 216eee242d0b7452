"""Validation: held-out loss and perplexity every `validation.freq` optimizer steps.

Held-out data is `validation.dataset_path` or the last `validation.holdout_documents` documents of the
local training data (which the training loader then never reads), packed as training data is. Every
evaluation starts from the loader's initial state and reads the same `validation.steps` batches, so its
values compare the same tokens and there is nothing to checkpoint. A batch's loss is the trainer's step
runner's (`StepRunner.evaluate`: the training model call and loss scope, cross-entropy), averaged over
the data-parallel ranks. Training does not notice it: no training batch is read, the forward runs under
`no_grad`, and the random-number states are forked and restored around it, so a run with validation
trains and resumes bitwise like one without. docs/metrics.md#validation has the rest.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from titanlite.data.loader import TokenLoader
from titanlite.metrics import ValidationResult
from titanlite.planning.run_plan import RunPlan
from titanlite.run.loader import build_validation_loader
from titanlite.run.step import StepRunner

logger = logging.getLogger("titanlite")


def passes_read(loader: TokenLoader) -> int:
    """The passes over its data that `loader`'s most-read virtual shard has begun (1: none wrapped)."""
    return 1 + max(shard["epoch"] for shard in loader.state_dict()["shards"].values())


class Validator:
    """Evaluates the model on the held-out batches; `Validator.create` gives None when validation is off."""

    def __init__(self, plan: RunPlan, dp_rank: int) -> None:
        self.plan = plan
        self.cfg = plan.cfg.validation
        self.loader = build_validation_loader(plan, dp_rank)
        self._start = self.loader.state_dict()
        self._passes_checked = False

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
        if not self._passes_checked:
            self._passes_checked = True
            self._report_repeats(device)
        # The mean over the replicas and, under context parallelism, over each sequence's equal parts.
        for mesh in self.plan.dims.loss_meshes:
            dist.all_reduce(total, op=dist.ReduceOp.AVG, group=mesh.get_group())
        tokens = self.cfg.steps * self.plan.dims.sequences(self.cfg.local_batch_size) * self.plan.cfg.training.seq_len
        return ValidationResult(total.item(), time.perf_counter() - start, tokens)

    def _report_repeats(self, device: torch.device) -> None:
        """After the first evaluation: held-out data smaller than one evaluation is read more than once
        by every evaluation (its shards start over); said once, as a warning, on every rank."""
        passes = torch.tensor(passes_read(self.loader), device=device)
        if self.plan.dims.dp_mesh is not None:
            dist.all_reduce(passes, op=dist.ReduceOp.MAX, group=self.plan.dims.dp_mesh.get_group())
        if passes.item() > 1:
            v, t = self.cfg, self.plan.cfg.training
            logger.warning(
                f"validation: the held-out data is smaller than one evaluation (validation.steps {v.steps} x "
                f"{self.plan.dims.describe_batch(f'validation.local_batch_size {v.local_batch_size}')} sequences of "
                f"training.seq_len {t.seq_len} tokens): each evaluation reads some of its documents up to "
                f"{passes.item()} times; hold out more documents or lower validation.steps"
            )
