"""CheckpointManager: the checkpoints of a run, saved on its interval and read back when it starts.

Each save writes the whole training state (`training_state.py`: DCP tensors, resharded to any layout on
load) and every rank's data loader and RNG states (`rank_state.py`) into a folder that appears only when
complete (`folders.py`), synchronously or staged and written in the background (`async_save.py`); rank 0
then retires the oldest checkpoints (`purge.py`). A failed save removes its `.partial` folder and warns;
the run's last save is confirmed, so a run whose last save failed never ends as a success (`RunNotSaved`).
Node-local copies are written on their own interval (`node_local.py`). Loading is the `Resumer`'s
(`resume.py`). What each case logs and exits with: docs/checkpoints.md, docs/failure_handling.md.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from titanlite import faults, torch_support
from titanlite.checkpoint import folders, lineage, node_local, rank_state
from titanlite.checkpoint.async_save import AsyncWriter, Pending
from titanlite.checkpoint.checksumming_writer import ChecksummingWriter
from titanlite.checkpoint.purge import Purger, Stopping, never
from titanlite.checkpoint.rank_group import RankGroup
from titanlite.checkpoint.resume import Resumer
from titanlite.checkpoint.resume_policy import RunRecord
from titanlite.checkpoint.save_failure import save_failure
from titanlite.checkpoint.shared_folder import check_shared
from titanlite.checkpoint.training_state import TrainingState
from titanlite.checkpoint.weights import quiet_single_process_dcp
from titanlite.errors import RunNotSaved
from titanlite.planning.run_plan import RunPlan

logger = logging.getLogger("titanlite")


class CheckpointManager:
    """Saves and restores model, optimizer, LR schedule, step, data loader and RNG (module docstring).

    Saves forced while checkpointing is disabled (preemption) are synchronous: no writer thread or
    process group is set up for a run that does not checkpoint. `stopping` tells whether a stop signal
    ends the run (then `close` does not wait for deletions).
    """

    def __init__(
        self,
        plan: RunPlan,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler,
        dataloader,
        rank: int,
        device: torch.device,
        stopping: Stopping = never,
    ):
        cfg = plan.cfg
        self.plan, self.cfg = plan, cfg.checkpoint
        self.dims, self.rank, self.world_size = plan.dims, rank, plan.dims.world_size
        self.root = Path(cfg.job.dump_folder) / self.cfg.folder
        self.dp_rank, self.dp_degree = self.dims.dp_rank_of(rank), self.dims.dp
        self.state = TrainingState(
            model,
            optimizer,
            lr_scheduler,
            dataloader,
            rank=rank,
            dp_rank=self.dp_rank,
            dp_degree=self.dp_degree,
            device=device,
        )
        self.group = RankGroup(device, self.world_size)
        quiet_single_process_dcp()
        self._pending: Pending | None = None
        self._last_saved = -1
        self._published: int | None = None  # the step of this run's newest published checkpoint (rank 0)
        self._final = -1  # the step of a save whose failure ends the run (the last step's, a stop signal's)
        self._failures: dict[int, str] = {}  # step -> why its save failed
        self._record = RunRecord(plan, dataloader, rank)
        self._purger = Purger()  # rank 0 deletes; its thread starts with the first folder handed over
        self._stopping = stopping
        if self.cfg.enable:
            check_shared(self.root, rank, self.world_size)
        async_save = self.cfg.enable and self.cfg.async_mode != "disabled"
        self._writer = AsyncWriter(self.cfg.async_mode, cfg.comm, device, rank) if async_save else None
        local = self.cfg.enable and self.cfg.local_interval > 0
        self._local = node_local.NodeLocal(node_local.folder_of(self.cfg, cfg.job.dump_folder), rank) if local else None

    # --- save -------------------------------------------------------------------------------------------

    def save(self, step: int, *, force: bool = False, last_step: bool = False, model_only: bool = False) -> None:
        """Save after `step` if due (enabled and on the interval or the last step) or if `force`. A forced
        or last-step save is the run's last: `confirm` tells whether it was written."""
        self._poll()
        due = self.due(step, last_step)
        if force or (due and last_step):
            self._final = step
        if (force or due) and step != self._last_saved:
            dtype = None
            if last_step and self.cfg.last_save_model_only:
                model_only, dtype = True, torch_support.dtype(self.cfg.export_dtype)
            self._wait_pending()
            self._save(step, model_only, dtype)
        if self._local is not None and step % self.cfg.local_interval == 0 and not (force or last_step):
            self._local.save(step, self.state.full(step)[0], self.state.rank_state())
        faults.checkpoint_kill(step, "after_save")

    def due(self, step: int, last_step: bool = False) -> bool:
        """Whether `save(step)` saves without `force`: enabled, and on the interval or the last step."""
        return self.cfg.enable and (last_step or step % self.cfg.interval == 0)

    def _save(self, step: int, model_only: bool, dtype: torch.dtype | None) -> None:
        """Collective. Rank 0 prepares `step-N.partial`; every rank writes its rank-state file, then DCP
        writes the tensors. The ranks agree after each part, so a failure on one rank (full disk) makes
        every rank skip the save instead of leaving the others waiting in DCP's collectives."""
        start = time.perf_counter()
        error: Exception | None = None
        path = folders.partial_dir(self.root, step)
        if self.rank == 0:
            try:
                folders.prepare(self.root, step, self._purger.submit)
            except OSError as e:
                error = e
        if self.group.all_ok(error is None):  # the folder exists before any rank writes into it
            state = self.state.model_state(dtype) if model_only else self.state.full(step)[0]
            if not model_only:
                try:
                    rank_state.write(path, self.rank, self.state.rank_state())
                except OSError as e:
                    error = e
        if not self.group.all_ok(error is None):
            self._failed(step, path, error or RuntimeError("another rank could not write its part"))
            return
        info = {
            "model_only": model_only,
            "dtype": self.cfg.export_dtype if dtype is not None else "float32",
            **self._record.layout(),
            "launch": lineage.launch_id(),
            **(self._record.inputs() if self.rank == 0 else {}),
        }
        self._last_saved = step
        writer = ChecksummingWriter(str(path))
        if self._writer is not None:
            try:
                future = self._writer.start(state, writer)
            except (Exception, CheckpointException) as e:
                self._failed(step, path, e)
                return
            self._pending = Pending(step, path, info, future, start)
            if self.rank == 0:
                logger.info(
                    f"checkpoint step {step}: staged in {time.perf_counter() - start:.2f}s, writing in background"
                )
            return
        try:
            dcp.save(state, storage_writer=writer)
        except (Exception, CheckpointException) as e:  # DCP reports a failure on any rank to every rank
            self._failed(step, path, e)
            return
        self._finalize(step, path, info, start)

    def _finalize(self, step: int, path: Path, info: dict, start: float) -> None:
        """Rank 0 publishes the written folder (marker + rename), then retires old checkpoints, which its
        purge thread deletes while training goes on (at most `purge.PRUNE_BACKLOG` at a time)."""
        if self.rank != 0:
            return
        faults.checkpoint_kill(step, "mid_save")
        try:
            final = folders.complete(self.root, step, info, self._purger.submit)
            self._published = step
            pruned = self._purger.prune(self.root, self.cfg.keep_latest_k, step)
        except OSError as e:
            self._failed(step, path, e)
            return
        what = "model weights" if info["model_only"] else "training state"
        logger.info(f"checkpoint step {step}: {what} saved to {final} in {time.perf_counter() - start:.2f}s{pruned}")

    def _failed(self, step: int, path: Path, error: BaseException) -> None:
        """Drop the partial folder; stop (checkpoint.stop_on_save_error, or a seed checkpoint, which is the
        run's only product), or warn and keep training; the run's last save is reported by `confirm`."""
        message = save_failure(step, path, error)
        self._failures[step] = message
        if self.rank == 0 and path.exists():
            try:
                self._purger.submit(folders.retire(path))
            except OSError as e:
                logger.warning(f"checkpoint: could not remove {path}: {e}")
        if self.cfg.stop_on_save_error or self.cfg.create_seed_checkpoint:
            raise RunNotSaved(f"{message}; {self._last_good()}")
        if step != self._final:
            logger.warning(message + "; training continues (checkpoint.stop_on_save_error = false)")

    def _last_good(self) -> str:
        done = folders.scan(self.root)[0]
        return (
            f"the last good checkpoint is {folders.step_dir(self.root, done[-1])}"
            if done
            else "no checkpoint was saved"
        )

    def confirm(self, step: int, what: str) -> str:
        """Wait for the run's last save (of `step`, forced or the last step's) and return its folder; if it
        failed, raise `RunNotSaved` with `what` happened, the cause and the last good checkpoint."""
        self.close()
        if step in self._failures:
            raise RunNotSaved(f"{what}, but {self._failures[step]}; {self._last_good()}")
        if self._local is not None:  # the run ends cleanly: its node-local copies are of no further use
            self._local.remove_all()
        return str(folders.step_dir(self.root, step))

    def _poll(self) -> None:
        if self._pending is not None and self._pending.future.done():
            self._wait_pending()

    def _wait_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.future.result()
        except (Exception, CheckpointException) as e:
            self._failed(pending.step, pending.path, e)
            return
        self._finalize(pending.step, pending.path, pending.info, pending.started)

    def last_complete(self) -> str | None:
        """The newest complete checkpoint folder, once any save in flight has finished; None if there is none.

        Read from the folder names (a `step-N` folder is complete by construction). On ranks other than 0
        it may lag rank 0's rename of a just-finished async save: it is meant for messages.
        """
        self._wait_pending()
        done, _ = folders.scan(self.root)
        return str(folders.step_dir(self.root, done[-1])) if done else None

    def close(self) -> None:
        """Wait for an async save in flight and finalise it, then (rank 0) for the deletions it started,
        unless a stop signal ends the run (`purge.Purger.finish`); wait for a node-local write in flight."""
        if self._local is not None:
            self._local.close()
        self._wait_pending()
        if self._writer is not None:
            self._writer.close()
        if self.rank == 0:
            self._purger.finish(self.root, self.cfg.keep_latest_k, self._published, self._stopping)

    # --- load -------------------------------------------------------------------------------------------

    def load(self) -> int:
        """Restore the newest usable checkpoint (or `load_step`, or `initial_load_path`); the step to resume from."""
        return Resumer(
            self.plan,
            self.state,
            self.group,
            root=self.root,
            record=self._record,
            purger=self._purger,
            local=self._local,
        ).load()
