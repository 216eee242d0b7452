"""Resumer: restoring a run from its checkpoints when it starts, before its first step.

A resume verifies checksums and the settings that cannot change (`resume_policy.py`) before loading
anything, so an unusable checkpoint fails with the model untouched or gives way to the previous one. It
prefers a newer node-local copy that every rank holds (`node_local.py`), else loads the newest usable
durable folder (or `load_step`, or `initial_load_path`), resharding tensors to this run's layout and
taking the data loader and RNG states by the rule in `rank_state.py`. Once every rank has loaded, the
checkpoints newer than the step resumed are moved aside (`lineage.py`). What each case logs and exits
with: docs/checkpoints.md, docs/failure_handling.md.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch.distributed.checkpoint as dcp

from titanlite.checkpoint import folders, lineage, node_local, rank_state
from titanlite.checkpoint.lr_schedule import config_groups
from titanlite.checkpoint.purge import Purger
from titanlite.checkpoint.rank_group import RankGroup
from titanlite.checkpoint.resume_policy import ResumeCheck, RunRecord, model_change
from titanlite.checkpoint.training_state import TrainingState
from titanlite.checkpoint.weights import check_compatible, load_initial_weights, load_model_weights, verify_checksums
from titanlite.errors import CheckpointError
from titanlite.parallelisms.parallel_dims import WorldLayout
from titanlite.planning.run_plan import RunPlan

logger = logging.getLogger("titanlite")


class Resumer:
    """Loads the checkpoint a run resumes from (module docstring); `CheckpointManager.load` runs it."""

    def __init__(
        self,
        plan: RunPlan,
        state: TrainingState,
        group: RankGroup,
        *,
        root: Path,
        record: RunRecord,
        purger: Purger,
        local: node_local.NodeLocal | None,
    ):
        self.plan, self.cfg, self.state, self.group = plan, plan.cfg.checkpoint, state, group
        self.root, self.rank = root, state.rank
        self._record, self._purger, self._local = record, purger, local
        self._verify_seconds = 0.0

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
                load_model_weights(self.state.model, choice.path)
                step = 0
            else:
                step = self._load_full(choice.path, choice.marker)
            self._set_aside(step)
            return step
        if self.cfg.initial_load_path:
            load_initial_weights(self.state.model, self.plan, self.cfg.initial_load_path, self._log)
        return 0

    def _set_aside(self, step: int) -> None:
        """Collective, once every rank has loaded step `step`: rank 0 moves the newer checkpoints (the line
        this run leaves) aside (`lineage.py`); if it cannot, the run stops before its saves overwrite them."""
        error = None
        if self.group.all_ok(True) and self.rank == 0:  # no rank reads the folders any more
            try:
                if line := lineage.set_aside(self.root, step):
                    logger.info(line)
            except OSError as e:
                error = f"checkpoint: cannot move the checkpoints after step {step} aside in {self.root}: {e}"
        if not self.group.all_ok(error is None):
            raise CheckpointError(error or f"checkpoint: rank 0 cannot move the checkpoints after step {step} aside")

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
        line, asked, durable = self.group.broadcast(known)
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
        newest, durable = node_local.agree(mine, durable, self.state.device)
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
        fresh_optimizer = not self.state.optimizer.state
        state, model_sd, optim_sd = self.state.full(0)
        if found is not None:
            problem = node_local.misfit(state, found.payload["state"])
        problems = self.group.gather(problem)
        if found is None or any(problems):
            if fresh_optimizer:  # torch filled it to list its entries (a step with zero gradients and lr 0)
                self.state.optimizer.state.clear()  # a run that starts over starts without it, as with no checkpoint
            rank = next(r for r, p in enumerate(problems) if p)
            return self._fall_back(f"of step {step} is unusable on rank {rank}: {problems[rank]}", durable)
        resume = self.group.broadcast(self._record.compare(str(found.path), found.record) if self.rank == 0 else None)
        self._settings(str(found.path), resume)
        fresh = config_groups(self.state.optimizer)
        node_local.restore(state, found.payload["state"])
        if resume.dataset_changed:
            if self.rank == 0:
                logger.warning(resume.dataset_changed)
        elif self.state.dataloader is not None:
            self.state.dataloader.load_state_dict(found.payload["rank_state"]["dataloader"])
        self.state.restore(state, model_sd, optim_sd, fresh)
        rank_state.restore_rng(found.payload["rank_state"], self.state.device)
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
            choice = self.group.broadcast(
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
        resume = self.group.broadcast(self._record.compare(path, marker) if self.rank == 0 else None)
        self._settings(path, resume)
        state, model_sd, optim_sd = self.state.full(0)
        check_compatible(path, state)
        fresh = config_groups(self.state.optimizer)
        old, new = WorldLayout.from_marker(marker), self.plan.dims.world_layout
        cache: dict[int, dict] = {}

        def read_rank(r: int) -> dict:
            if r not in cache:
                cache[r] = rank_state.read(Path(path), r)
            return cache[r]

        if resume.dataset_changed:
            if self.rank == 0:
                logger.warning(resume.dataset_changed)
        elif self.state.dataloader is not None:
            loader_state = rank_state.loader_state_for(self.state.dp_rank, new.dp, old, read_rank)
            if loader_state is None:
                raise CheckpointError(f"checkpoint {path} holds no data loader state")
            self.state.dataloader.load_state_dict(loader_state)
        dcp.load(state, checkpoint_id=path)
        self.state.restore(state, model_sd, optim_sd, fresh)
        rank_state.restore_rng(read_rank(self.rank % old.world_size), self.state.device)
        step = int(state["train_state"]["step"])
        self._log(
            f"checkpoint: resumed from {path} at step {step} in {time.perf_counter() - start:.2f}s "
            f"(checksums verified in {self._verify_seconds:.2f}s)"
            + (f" (resharded from {old.describe()})" if old != new else "")
        )
        return step
