"""This run as one replica group of a fault-tolerant job: torchft's manager, and the step's part across groups.

Each step, in the trainer's order:

    start_step()     the quorum of the live groups (waits up to quorum_timeout_seconds); a group behind the
                     others receives the state of one that is ahead (torchft's transfer from a live peer)
                     and learns the step it continues from
    average()        the gradients and the loss averaged over the quorum, one all-reduce per dtype, after the
                     group's own reduction and before clipping (`StepContext.across_replicas`)
    exchange_data()  each group's loader state after the step, for the others (`data_states.py`)
    commit()         torchft's vote: True when every group of the quorum finished its collectives; a step
                     that does not commit is retried on the same batches (a failed or late group's step)

The groups' parameters stay bitwise equal: they start from one group's state (torchft's sync at the first
quorum) and apply the same averaged gradients. The lowest live group writes the durable checkpoints
(`saves_checkpoints`). torchft is imported here only, by a run with `fault_tolerance.enable`.
"""

from __future__ import annotations

import logging
import os
import socket
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.errors import ConfigError, UserError
from titanlite.fault_tolerance import data_states
from titanlite.fault_tolerance.config import FaultTolerance, lighthouse_address
from titanlite.fault_tolerance.data_states import GroupLoaderStates

logger = logging.getLogger("titanlite")


class ReplicaGroupError(UserError):
    """The job's replica groups cannot go on with this group (no quorum, a refused join): one line, exit code 2."""


START_LIGHTHOUSE = (
    "start it with `scripts/python.sh -m titanlite.tools.lighthouse --min_replicas N --port P` and point "
    "fault_tolerance.lighthouse or TORCHFT_LIGHTHOUSE at it"
)
"""The hint of a group that found no lighthouse, or no quorum at it."""


def _first_line(error: BaseException) -> str:
    """torchft's error in a few words: its first line, cut to 160 characters."""
    return (str(error).splitlines() or [type(error).__name__])[0][:160]


def replica_name(replica_id: int) -> str:
    """The group's torchft replica id: zero-padded, so the lighthouse's order (by name) is the groups' order and
    the lowest live group is participant 0."""
    return f"titanlite_{replica_id:05d}"


class ReplicaGroup:
    """This run's membership of the job's replica groups (module docstring). `capture()` returns this rank's
    training state for a recovering peer, `restore(state)` applies a received one and returns its step; both
    are the run's (`run/replica_state.py`)."""

    def __init__(
        self,
        cfg: FaultTolerance,
        loaders: GroupLoaderStates | None,
        capture: Callable[[], dict],
        restore: Callable[[dict], int],
        device: torch.device,
    ):
        # torchft's Rust side logs every quorum and commit at INFO, some lines a step; a user's RUST_LOG wins.
        os.environ.setdefault("RUST_LOG", "warn")
        # Its Python side logs a failed collective with a traceback: `commit` names the error in one line.
        logging.getLogger("torchft").setLevel(logging.CRITICAL)
        # Reading a received state, torch warns once that torchft's buffer is read-only (it is only read).
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        from torchft.manager import Manager

        self.cfg, self.loaders, self._capture, self._restore = cfg, loaders, capture, restore
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.lighthouse = lighthouse_address(cfg, dict(os.environ))
        self.recoveries = 0
        """Times this group received a newer state from a peer, or sent one to a peer behind it."""
        self.healed_to: int | None = None
        self.last_error: str | None = None
        """Why this group's last step failed across groups (torchft's error, first sentence), or None."""
        self._step = 0
        host, port = self._group_store()
        try:
            self.manager = Manager(
                pg=_cross_group_process_group(device, cfg.timeout_seconds),
                load_state_dict=self._received,
                state_dict=self._sent,
                min_replica_size=cfg.min_replica_size,
                use_async_quorum=False,  # a received state is applied before the step's first collective
                timeout=timedelta(seconds=cfg.timeout_seconds),
                quorum_timeout=timedelta(seconds=cfg.quorum_timeout_seconds),
                connect_timeout=timedelta(seconds=cfg.connect_timeout_seconds),
                rank=self.rank,
                world_size=self.world,
                store_addr=host,
                store_port=port,
                lighthouse_addr=self.lighthouse,
                replica_id=replica_name(cfg.replica_id),
                init_sync=True,  # every group starts from one group's weights, and a different model is refused
            )
        except Exception as e:  # torchft's connect error: the lighthouse unreachable within connect_timeout
            raise ReplicaGroupError(
                f"fault_tolerance: could not join the lighthouse at {self.lighthouse} within "
                f"{cfg.connect_timeout_seconds:g} s ({_first_line(e)}); {START_LIGHTHOUSE}"
            ) from None

    def _group_store(self) -> tuple[str, int]:
        """A store of this group for torchft (the manager's address, the groups' rendezvous), new for every
        attempt: the launcher's store outlives a restart and would hand a restarted rank its previous
        attempt's manager. Rank 0 serves it on a free port; its address reaches the group's ranks."""
        if self.rank == 0:
            self._store = dist.TCPStore(socket.gethostname(), 0, is_master=True, wait_for_workers=False)
            address = [(socket.gethostname(), self._store.port)]
        else:
            address = [None]
        dist.broadcast_object_list(address, src=0)
        return address[0]

    def resume_at(self, step: int) -> None:
        """The step this group starts from (its checkpoint's): the quorum's source of the newest state."""
        self._step = step
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def start_step(self, step: int) -> int | None:
        """The quorum for the step after `step`; the step this group continues from when it received a newer
        state from a peer, else None."""
        self._step, self.healed_to = step, None
        try:
            self.manager.start_quorum()
        except ReplicaGroupError:
            raise
        except Exception as e:  # torchft's quorum error: the lighthouse unreachable, or no quorum in time
            raise ReplicaGroupError(
                f"fault_tolerance: no quorum of at least {self.cfg.min_replica_size} replica group(s) from the "
                f"lighthouse at {self.lighthouse} within {self.cfg.quorum_timeout_seconds:g} s "
                f"({_first_line(e)}); {START_LIGHTHOUSE}"
            ) from None
        healed, self.healed_to = self.healed_to, None
        if healed is None or healed <= step:
            return None
        self.recoveries += 1
        return healed

    def missed_steps(self, step: int) -> int:
        """Of the job's first `step` steps, those this group did not train (it was away, or joined late): its
        data position counts the steps it trained, over every restart (0 where the loader cannot tell)."""
        trained = self.loaders.trained_steps() if self.loaders is not None else None
        return step - trained if trained is not None else 0

    def average(self, model: nn.Module, loss: torch.Tensor) -> torch.Tensor:
        """The gradients of `model` (this rank's shards) and the step's `loss` averaged over the quorum, in
        place; the average loss returned. One all-reduce per gradient dtype, the loss with the float32 ones."""
        grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        loss = loss.detach().reshape(1).to(torch.float32)
        by_dtype.setdefault(torch.float32, []).append(loss)
        for tensors in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in tensors])
            self.manager.allreduce(flat).wait()
            for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
                t.copy_(part.view_as(t))
        return loss.reshape(())

    def exchange_data(self) -> dict[int, dict] | None:
        """Every group's loader state after this step (`data_states.py`), from the ranks of this index; None
        when the exchange failed (the step does not commit then)."""
        if self.loaders is None:
            return None
        g = self.cfg.group_size
        lengths, payload = data_states.encode(self.loaders.loader.state_dict(), self.cfg.replica_id, g)
        self.manager.allreduce(lengths, reduce_op=dist.ReduceOp.SUM).wait()
        if self.manager.errored() or int(lengths.max()) <= 0:
            return None
        rows = data_states.payload_rows(payload, self.cfg.replica_id, lengths)
        self.manager.allreduce(rows, reduce_op=dist.ReduceOp.SUM).wait()
        if self.manager.errored():
            return None
        return data_states.decode(rows, lengths)

    def commit(self, exchanged: dict[int, dict] | None) -> bool:
        """torchft's vote on the step (module docstring); a committed step's loader states are kept. Why a
        step did not commit, when this group saw it fail, is `last_error`."""
        error = self.manager.errored()
        committed = self.manager.should_commit()
        if committed and exchanged is not None and self.loaders is not None:
            self.loaders.adopt(exchanged)
        cause = error.original_exception if error is not None else None
        self.last_error = str(cause).split(". ")[0].strip()[:200] if cause is not None else None
        return committed

    def quorum_size(self) -> int:
        return self.manager.num_participants()

    def saves_checkpoints(self) -> bool:
        """Whether this group writes the durable checkpoints: it is the lowest live group of the quorum."""
        return self.manager.participating_rank() == 0

    def metrics(self, model: nn.Module, step: int) -> dict[str, float]:
        """The log step's `ft/` scalars; collective over the group (every rank calls it at each log)."""
        return {
            "ft/quorum_size": float(self.quorum_size()),
            "ft/recoveries": float(self.recoveries),
            "ft/missed_steps": float(self.missed_steps(step)),
            "ft/params_digest": float(params_digest(model)),
        }

    def close(self) -> None:
        self.manager.shutdown(wait=False)

    def _sent(self) -> dict:
        """This rank's state for a peer behind it (torchft asks while serving it)."""
        if self._step > 0:
            self.recoveries += 1
        return self._capture()

    def _received(self, state: dict) -> None:
        """A state from a peer ahead of this group (or the first quorum's sync): applied before this step."""
        try:
            self.healed_to = self._restore(state)
        except ConfigError as e:
            group = self.cfg.replica_id
            raise ReplicaGroupError(f"fault_tolerance: replica group {group} refused to join: {e}") from None


DIGEST_MODULUS = 1 << 24
"""The digest is kept below 2^24, so it is exact as a float32 (TensorBoard's scalars)."""


@torch.no_grad()
def params_digest(model: nn.Module) -> int:
    """The sum of the bit patterns of every parameter (this group's shards summed over its ranks), modulo
    2^24: equal in two groups whose parameters are bitwise equal, and moved by any one flipped bit."""
    total = torch.zeros((), dtype=torch.int64, device=next(model.parameters()).device)
    for p in model.parameters():
        local = _local(p.detach()).contiguous()
        bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[local.element_size()]
        total += local.view(bits).sum(dtype=torch.int64)
    if dist.is_initialized():
        dist.all_reduce(total)
    return int(total.item()) % DIGEST_MODULUS


def _local(t: torch.Tensor) -> torch.Tensor:
    """A gradient's tensor on this rank (its shard under SimpleFSDP or FSDP2)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _cross_group_process_group(device: torch.device, timeout_seconds: float) -> Any:
    """torchft's reconfigurable process group among the ranks of this index in every group: NCCL on CUDA,
    gloo elsewhere."""
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    timeout = timedelta(seconds=timeout_seconds)
    return ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
