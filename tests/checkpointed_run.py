"""An in-process run of the tiny model that checkpoints after every step, as the trainer's loop does: the
checkpoint tests' and the tokenizer tests' way of training, saving and resuming without a launch."""

from __future__ import annotations

from pathlib import Path

import torch
from builders import config
from torch.distributed.tensor import DTensor

from harness import tiny_args
from titanlite.data.tokenizer import build_tokenizer
from titanlite.models.llama3 import ModelArgs
from titanlite.planning.run_plan import RunPlan
from titanlite.run.trainer import Trainer

TOK = build_tokenizer(None)
SEQ, LBS = 8, 2
ARGS = tiny_args(n_layers=2, vocab_size=TOK.n_words)


class Run:
    """A trainer of the tiny model (one process), stepped by the shipped `Trainer.train_step` and saved
    after each step as the trainer's loop does."""

    def __init__(self, dump: Path, args: ModelArgs = ARGS, seed: int = 0, over: dict | None = None, **ckpt):
        """`ckpt`: checkpoint keys; `over`: any other `section.key` values."""
        cfg = config(
            dump,
            {"training__seq_len": SEQ, "training__local_batch_size": LBS, "training__steps": 20},
            {"training__seed": seed, "checkpoint__enable": True, "checkpoint__interval": 1},
            {f"checkpoint__{key}": value for key, value in ckpt.items()},
            {key.replace(".", "__"): value for key, value in (over or {}).items()},
        )
        self.cfg = cfg
        self.trainer = Trainer(cfg, RunPlan.build(cfg, 1, args=args))
        self.model, self.sched, self.loader = self.trainer.model, self.trainer.lr_scheduler, self.trainer.dataloader
        self.ckpt = self.trainer.checkpointer
        self.data = None

    def train(self, first: int, last: int) -> list[float]:
        """Steps first..last (1-based), saving after each as the Trainer does; returns the losses."""
        if self.data is None:
            self.data = iter(self.loader)
        losses = []
        for step in range(first, last + 1):
            self.trainer.step = step
            loss, _ = self.trainer.train_step([next(self.data)])
            losses.append(loss.item())
            self.ckpt.save(step, last_step=step == 20)
        return losses

    def params(self) -> dict[str, torch.Tensor]:
        return full_state(self.model)


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict as plain tensors (SimpleFSDP holds DTensor shards, here on one rank)."""
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()
    }
