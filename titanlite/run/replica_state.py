"""What a replica group hands a peer that is behind it, and applies when it is the one behind: this rank's
training state as a checkpoint holds it (`TrainingState.full`: the model, the AdamW state, the LR schedule),
its tensors as this rank's shards, with the step, every group's data position (`GroupLoaderStates.table`) and
the group's identity. The ranks of one index in every group hold the same shards (the same model and layout,
which the identity checks before anything is applied), so a shard goes from rank i of one group to rank i of
the other and is copied in place, as a checkpoint's load copies into the state it reads into.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from titanlite.checkpoint.lr_schedule import config_groups
from titanlite.checkpoint.training_state import TrainingState
from titanlite.errors import ConfigError
from titanlite.fault_tolerance.data_states import TABLE_KEY, GroupLoaderStates
from titanlite.planning.run_plan import RunPlan, describe_shape


def identity(plan: RunPlan) -> dict[str, str]:
    """What two groups must share to average their gradients: the model and its shape, the layout within a
    group, and the batch and sequence length (the data split is the job's)."""
    cfg, t = plan.cfg, plan.cfg.training
    return {
        "model": f"{cfg.model.name} {cfg.model.flavor} ({describe_shape(plan.spec, plan.model_args)}), "
        f"vocab {plan.model_args.vocab_size}",
        "layout": plan.dims.describe(),
        "batch": f"seq_len {t.seq_len}, local batch {t.local_batch_size}, "
        f"global batch {plan.global_batch * plan.replica_groups}",
    }


class ReplicaState:
    """`capture` and `restore` of this rank's state for `fault_tolerance.ReplicaGroup` (module docstring)."""

    def __init__(
        self,
        state: TrainingState,
        loaders: GroupLoaderStates | None,
        plan: RunPlan,
        step: Callable[[], int],
    ):
        self.state, self.loaders, self.identity, self.step = state, loaders, identity(plan), step

    def capture(self) -> dict:
        step = self.step()
        fresh = not self.state.optimizer.state
        full, _, _ = self.state.full(step)
        captured = {
            "identity": self.identity,
            "step": step,
            "state": _shards(full),
            "fresh_optimizer": fresh,
            "data": self.loaders.table() if self.loaders is not None else None,
        }
        if fresh:  # torch filled it to list its entries (a step with zero gradients and lr 0): not trained on
            self.state.optimizer.state.clear()
        return captured

    def restore(self, received: dict) -> int:
        """Apply a peer's `capture` (a `ConfigError` naming the first difference when the groups differ, before
        anything changes); returns its step."""
        for key, ours in self.identity.items():
            theirs = received["identity"].get(key)
            if theirs != ours:
                raise ConfigError(f"the live group's {key} is {theirs}, this group's {ours}")
        fresh = config_groups(self.state.optimizer)
        full, model_sd, optim_sd = self.state.full(0)
        _copy_into(full, received["state"])
        self.state.restore(full, model_sd, optim_sd, fresh)
        if received["fresh_optimizer"]:  # as the sender's: AdamW's first step still to come
            self.state.optimizer.state.clear()
        if self.loaders is not None and received["data"] is not None:
            self.loaders.load_state_dict({TABLE_KEY: received["data"]})
        return int(received["step"])


def _shards(tree: Any) -> Any:
    """`tree` with each DTensor as this rank's shard; tensors on the host copied (the peer reads them while
    this group computes its next step's gradients)."""
    if isinstance(tree, dict):
        return {k: _shards(v) for k, v in tree.items()}
    if isinstance(tree, torch.Tensor):
        local = tree.to_local() if isinstance(tree, DTensor) else tree
        return local.detach().clone() if local.device.type == "cpu" else local.detach()
    return tree


def _copy_into(dst: dict, src: dict) -> None:
    """Each tensor of `dst` (its shard for a DTensor) overwritten in place from `src`, other values replaced."""
    for key, value in dst.items():
        if key not in src:
            raise ConfigError(f"the live group's state has no {key!r}")
        if isinstance(value, dict):
            _copy_into(value, src[key])
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if isinstance(value, DTensor) else value
            local.copy_(src[key])
        else:
            dst[key] = src[key]
