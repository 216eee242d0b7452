"""TrainingState: what a checkpoint holds, read from the live training objects and handed back to them.

One DCP state dict holds the model's parameters at the top level (as TorchTitan stores them, so a
model-only load reads a seed checkpoint and a full one alike), the AdamW state flattened by FQN, the LR
schedule and the step, so every tensor reshards to any layout on load. The per-rank part (the data
loader position and the RNG states, `rank_state.py`) is not a tensor and is captured apart. Saving,
resuming from the durable folder and resuming from a node-local copy all read and restore the state
here, so the three agree on its layout (`weights.NOT_MODEL` names the entries beside the model's).
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from titanlite.checkpoint import rank_state
from titanlite.checkpoint.lr_schedule import restore_schedule
from titanlite.checkpoint.weights import sharded

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class TrainingState:
    """The model, optimizer, LR schedule and data loader of one rank, as checkpoint state dicts."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler,
        dataloader,
        *,
        rank: int,
        dp_rank: int,
        dp_degree: int,
        device: torch.device,
    ):
        self.model, self.optimizer, self.lr_scheduler, self.dataloader = model, optimizer, lr_scheduler, dataloader
        self.rank, self.dp_rank, self.dp_degree, self.device = rank, dp_rank, dp_degree, device

    def model_state(self, dtype: torch.dtype | None = None) -> dict:
        """The model's parameters alone (a model-only save), cast to `dtype` if given."""
        model_sd = sharded(get_model_state_dict, self.model)
        if dtype is not None:
            model_sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in model_sd.items()}
        return model_sd

    def full(self, step: int) -> tuple[dict, dict, dict]:
        """(the DCP state dict, its model part, its optimizer part): DCP loads into the latter two in place."""
        model_sd, optim_sd = sharded(get_state_dict, self.model, self.optimizer, options=_OPTIONS)
        state = {
            **model_sd,
            "optimizer": optim_sd,
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "train_state": {"step": step},
        }
        return state, model_sd, optim_sd

    def rank_state(self) -> dict:
        """This rank's data loader position and RNG states (`rank_state.capture`)."""
        return rank_state.capture(
            self.dataloader, rank=self.rank, dp_rank=self.dp_rank, dp_degree=self.dp_degree, device=self.device
        )

    def restore(self, state: dict, model_sd: dict, optim_sd: dict, fresh: list[dict]) -> None:
        """Hand a loaded `full` state to the model, optimizer and schedule (`fresh`: `config_groups`, read
        before anything was loaded)."""
        sharded(
            set_state_dict,
            self.model,
            self.optimizer,
            model_state_dict=model_sd,
            optim_state_dict=optim_sd,
            options=_OPTIONS,
        )
        restore_schedule(self.lr_scheduler, self.optimizer, state["lr_scheduler"], fresh)
