"""CheckpointManager: DCP save/load of the whole training state, atomic folders, async saves, resharding.

One DCP state dict holds the model's parameters at the top level (as TorchTitan stores them, so a
model-only load reads a seed checkpoint and a full one alike), the AdamW state flattened by FQN, the LR
schedule and the step, so every tensor reshards to any layout on load; per-rank files hold the data
loader and RNG states (`rank_state.py`), inside a folder that appears only when complete (`folders.py`).
A failed save removes its `.partial` folder and warns; the run's last save is confirmed, so a run whose
last save failed never ends as a success (`RunNotSaved`). A resume verifies checksums and the settings
that cannot change (`resume_policy.py`) before loading anything, and prefers a newer node-local copy
(`node_local.py`). What each case logs and exits with: docs/checkpoints.md, docs/failure_handling.md.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from titanlite import faults, torch_support
from titanlite.checkpoint import folders, lineage, node_local, rank_state
from titanlite.checkpoint.async_save import AsyncWriter, Pending
from titanlite.checkpoint.checksumming_writer import ChecksummingWriter
from titanlite.checkpoint.lr_schedule import config_groups, restore_schedule
from titanlite.checkpoint.purge import Purger, Stopping, never
from titanlite.checkpoint.resume_policy import ResumeCheck, RunRecord, model_change
from titanlite.checkpoint.save_failure import save_failure
from titanlite.checkpoint.shared_folder import check_shared
from titanlite.checkpoint.weights import (
    check_compatible,
    load_initial_weights,
    load_model_weights,
    quiet_single_process_dcp,
    sharded,
    verify_checksums,
)
from titanlite.errors import CheckpointError, RunNotSaved
from titanlite.parallelisms.parallel_dims import WorldLayout
from titanlite.planning.run_plan import RunPlan

logger = logging.getLogger("titanlite")

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


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
        self.model, self.optimizer, self.lr_scheduler, self.dataloader = model, optimizer, lr_scheduler, dataloader
        self.dims, self.rank, self.world_size, self.device = plan.dims, rank, plan.dims.world_size, device
        self.root = Path(cfg.job.dump_folder) / self.cfg.folder
        self.dp_rank, self.dp_degree = self.dims.dp_rank_of(rank), self.dims.dp
        quiet_single_process_dcp()
        self._pending: Pending | None = None
        self._last_saved = -1
        self._published: int | None = None  # the step of this run's newest published checkpoint (rank 0)
        self._final = -1  # the step of a save whose failure ends the run (the last step's, a stop signal's)
        self._failures: dict[int, str] = {}  # step -> why its save failed
        self._verify_seconds = 0.0
        self._record = RunRecord(plan, dataloader, rank)
        self._purger = Purger()  # rank 0 deletes; its thread starts with the first folder handed over
        self._stopping = stopping
        if self.cfg.enable:
            check_shared(self.root, rank, self.world_size)
        async_save = self.cfg.enable and self.cfg.async_mode != "disabled"
        self._writer = AsyncWriter(self.cfg.async_mode, cfg.comm, device, rank) if async_save else None
        local = self.cfg.enable and self.cfg.local_interval > 0
        self._local = node_local.NodeLocal(node_local.folder_of(self.cfg, cfg.job.dump_folder), rank) if local else None

    # --- state ------------------------------------------------------------------------------------------

    def _model_state(self, dtype: torch.dtype | None = None) -> dict:
        model_sd = sharded(get_model_state_dict, self.model)
        if dtype is not None:
            model_sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in model_sd.items()}
        return model_sd

    def _full_state(self, step: int) -> tuple[dict, dict, dict]:
        """(the DCP state dict, its model part, its optimizer part): DCP loads into the latter two in place."""
        model_sd, optim_sd = sharded(get_state_dict, self.model, self.optimizer, options=_OPTIONS)
        state = {
            **model_sd,
            "optimizer": optim_sd,
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "train_state": {"step": step},
        }
        return state, model_sd, optim_sd

    def _rank_state(self) -> dict:
        return rank_state.capture(
            self.dataloader, rank=self.rank, dp_rank=self.dp_rank, dp_degree=self.dp_degree, device=self.device
        )

    def _set_state(self, state: dict, model_sd: dict, optim_sd: dict, fresh: list[dict]) -> None:
        """Hand a loaded `_full_state` to the model, optimizer and schedule (`fresh`: `config_groups`, read
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

    # --- collectives on the training process group (main thread only) -------------------------------

    def _all_ok(self, ok: bool) -> bool:
        if not dist.is_initialized():
            return ok
        flag = torch.tensor([int(ok)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _broadcast(self, obj):
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

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
            self._local.save(step, self._full_state(step)[0], self._rank_state())
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
        if self._all_ok(error is None):  # the folder exists before any rank writes into it
            state = self._model_state(dtype) if model_only else self._full_state(step)[0]
            if not model_only:
                try:
                    rank_state.write(path, self.rank, self._rank_state())
                except OSError as e:
                    error = e
        if not self._all_ok(error is None):
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
        choice = folders.Choice()
        if self.cfg.enable:
            if self.rank == 0:  # retired folders a crash left: deleted in the background
                for path in folders.retired(self.root):
                    self._purger.submit(path)
            if self._local is not None and (step := self._resume_local()) is not None:
                self._set_aside(step)
                return step
            choice = self._choose()
        if choice.error:
            raise CheckpointError(choice.error)
        if choice.path is not None:
            if choice.marker.get("model_only"):
                if change := model_change(choice.marker, self.plan.cfg.to_dict()):
                    key, was, now = change
                    raise CheckpointError(
                        f"checkpoint {choice.path}: {key} was {was}, this run has {now}; it cannot change when "
                        "resuming (restore it, or train in another job.dump_folder)"
                    )
                self._log(f"checkpoint: loading model weights from {choice.path} (model-only); starting at step 0")
                load_model_weights(self.model, choice.path)
                step = 0
            else:
                step = self._load_full(choice.path, choice.marker)
            self._set_aside(step)
            return step
        if self.cfg.initial_load_path:
            load_initial_weights(self.model, self.plan, self.cfg.initial_load_path, self._log)
        return 0

    def _set_aside(self, step: int) -> None:
        """Collective, once every rank has loaded step `step`: rank 0 moves the newer checkpoints (the line
        this run leaves) aside (`lineage.py`); if it cannot, the run stops before its saves overwrite them."""
        error = None
        if self._all_ok(True) and self.rank == 0:  # no rank reads the folders any more
            try:
                if line := lineage.set_aside(self.root, step):
                    logger.info(line)
            except OSError as e:
                error = f"checkpoint: cannot move the checkpoints after step {step} aside in {self.root}: {e}"
        if not self._all_ok(error is None):
            raise CheckpointError(error or f"checkpoint: rank 0 cannot move the checkpoints after step {step} aside")

    def _gather(self, obj) -> list:
        if not dist.is_initialized():
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def _resume_local(self) -> int | None:
        """Collective: load the newest node-local step every rank holds when it is newer than the durable
        checkpoint the run would load, and return it; None when the durable one is to be loaded
        (`node_local.py`). Rank 0 names the rank and the reason when copies newer than it are not used."""
        local, start = self._local, time.perf_counter()
        assert local is not None
        known = None
        if self.rank == 0:
            asked = lineage.load_step(self.root, self.cfg.load_step)
            done = folders.scan(self.root)[0]
            try:
                known = (node_local.line_of(self.root), asked, (done[-1] if done else 0) if asked < 0 else asked)
            except OSError as e:
                known = (None, f"checkpoint: cannot record the line of training in {self.root}: {e}", 0)
        line, asked, durable = self._broadcast(known)
        if line is None:
            raise CheckpointError(asked)
        parallelism = self.plan.cfg.to_dict()["parallelism"]  # what places each shard: a copy is not resharded
        layout = {**self._record.layout(), **{f"parallelism.{k}": v for k, v in parallelism.items()}}
        local.record = {"line": line, "launch": lineage.launch_id(), **layout}
        if self.rank == 0:
            local.record.update(self._record.inputs())

        def unfit(record: dict) -> str | None:
            """Why a copy is not this run's to resume: another line or layout; after `load_step`, any but a
            restarted attempt's own launch's."""
            if record.get("line") != line:
                return f"its line of training is not that of {self.root} (deleted or replaced since it was written)"
            if changed := next((k for k, v in layout.items() if record.get(k) != v), None):
                return f"it was written with {changed} {record.get(changed)}, this run has {layout[changed]}"
            if asked >= 0 and not (lineage.restarted() and record.get("launch") == lineage.launch_id()):
                return f"checkpoint.load_step {asked} is loaded instead"
            return None

        mine, passed = local.newest(unfit)
        newest, durable = node_local.agree(mine, durable, self.device)
        if passed and passed[0] > durable:  # rank 0's: the others' copies were written alike
            self._log(f"checkpoint: the node-local copy {local.step_dir(passed[0])} is not used: {passed[1]}")
        step, best = min(newest), max(newest)
        if best <= durable:
            local.keep_only(None)  # none newer than the durable checkpoint
            return None
        if step <= durable:
            held = f"its newest is step {step}" if step >= 0 else "it holds none"
            return self._fall_back(f"of step {best} is missing on rank {newest.index(step)} ({held})", durable)
        found, problem = local.read(step)
        fresh_optimizer = not self.optimizer.state
        state, model_sd, optim_sd = self._full_state(0)
        if found is not None:
            problem = node_local.misfit(state, found.payload["state"])
        problems = self._gather(problem)
        if found is None or any(problems):
            if fresh_optimizer:  # torch filled it to list its entries (a step with zero gradients and lr 0)
                self.optimizer.state.clear()  # a run that starts over starts without it, as with no checkpoint
            rank = next(r for r, p in enumerate(problems) if p)
            return self._fall_back(f"of step {step} is unusable on rank {rank}: {problems[rank]}", durable)
        resume = self._broadcast(self._record.compare(str(found.path), found.record) if self.rank == 0 else None)
        self._settings(str(found.path), resume)
        fresh = config_groups(self.optimizer)
        node_local.restore(state, found.payload["state"])
        if resume.dataset_changed:
            if self.rank == 0:
                logger.warning(resume.dataset_changed)
        elif self.dataloader is not None:
            self.dataloader.load_state_dict(found.payload["rank_state"]["dataloader"])
        self._set_state(state, model_sd, optim_sd, fresh)
        rank_state.restore_rng(found.payload["rank_state"], self.device)
        local.keep_only(step)
        if self.rank == 0:
            folders.retire_partials(self.root, self._purger.submit)
        self._log(
            f"checkpoint: resuming from the node-local checkpoint of step {step} (newer than the durable step "
            f"{durable}), read from {local.folder.parent} in {time.perf_counter() - start:.2f}s"
        )
        return step

    def _fall_back(self, why: str, durable: int) -> None:
        """The node-local copies are not used: say `why` (rank 0), delete them, load the durable checkpoint."""
        self._log(f"checkpoint: the node-local checkpoint {why}; falling back to the durable step {durable}")
        assert self._local is not None
        self._local.keep_only(None)

    def _settings(self, path: str, resume: ResumeCheck) -> None:
        """Stop on a setting that cannot change since checkpoint `path`; log those that changed (rank 0)."""
        if resume.error:
            raise CheckpointError(resume.error)
        if resume.changed:
            self._log(f"checkpoint: settings changed since {path}: {', '.join(resume.changed)} (the new values apply)")
        if resume.not_applied and self.rank == 0:
            logger.warning(
                f"checkpoint: {', '.join(resume.not_applied)}: not read, the run resumes from {path} (initial "
                "weights are read by a run without checkpoints of its own)"
            )

    def _choose(self) -> folders.Choice:
        """Rank 0 picks a folder by the cheap checks (`folders.choose`), then every rank verifies its share
        of the checksums; a mismatch is reported in one line and the previous folder is tried (an explicit
        `load_step` fails instead)."""
        rejected: dict[int, str] = {}
        load_step = lineage.load_step(self.root, self.cfg.load_step) if self.rank == 0 else self.cfg.load_step
        while True:
            choice = self._broadcast(
                folders.choose(self.root, load_step, self._purger.submit, rejected) if self.rank == 0 else None
            )
            if choice.error or choice.path is None:
                return choice
            start = time.perf_counter()
            why = verify_checksums(choice.path, choice.marker)
            self._verify_seconds = time.perf_counter() - start
            if why is None:
                return choice
            rejected[choice.marker["step"]] = why
            if load_step < 0 and self.rank == 0:
                logger.warning(f"checkpoint {choice.path} is unusable: {why}; trying the previous one")

    def _log(self, message: str) -> None:
        if self.rank == 0:
            logger.info(message)

    def _load_full(self, path: str, marker: dict) -> int:
        """Shapes are checked and the data loader state is taken (resharding rule in rank_state.py) before
        any tensor is loaded, so an incompatible checkpoint fails with the model untouched."""
        start = time.perf_counter()
        resume = self._broadcast(self._record.compare(path, marker) if self.rank == 0 else None)
        self._settings(path, resume)
        state, model_sd, optim_sd = self._full_state(0)
        check_compatible(path, state)
        fresh = config_groups(self.optimizer)
        old, new = WorldLayout.from_marker(marker), self.dims.world_layout
        cache: dict[int, dict] = {}

        def read_rank(r: int) -> dict:
            if r not in cache:
                cache[r] = rank_state.read(Path(path), r)
            return cache[r]

        if resume.dataset_changed:
            if self.rank == 0:
                logger.warning(resume.dataset_changed)
        elif self.dataloader is not None:
            loader_state = rank_state.loader_state_for(self.dp_rank, new.dp, old, read_rank)
            if loader_state is None:
                raise CheckpointError(f"checkpoint {path} holds no data loader state")
            self.dataloader.load_state_dict(loader_state)
        dcp.load(state, checkpoint_id=path)
        self._set_state(state, model_sd, optim_sd, fresh)
        rank_state.restore_rng(read_rank(self.rank % old.world_size), self.device)
        step = int(state["train_state"]["step"])
        self._log(
            f"checkpoint: resumed from {path} at step {step} in {time.perf_counter() - start:.2f}s "
            f"(checksums verified in {self._verify_seconds:.2f}s)"
            + (f" (resharded from {old.describe()})" if old != new else "")
        )
        return step
