"""The Trainer: builds a run from its config (through `titanlite.run.build`) and runs the step loop.

`Trainer.__init__` reads as the order of a rank's set-up: device, logging and the run's folder locks,
the plan, the data (before the process group, so bad data is reported before any rank waits), the
process group, the model, the optimizer, then the checkpointer and the metrics. `Trainer.train_step` is
the one training step (gradients, agreement across ranks on stop signals and non-finite values, the
optimizer and LR-schedule step); the loop in `Trainer.train` adds data, metrics, profiling, checkpoints
and the tests' step faults (`faults.StepFaults`) around it. Tests and benchmarks drive this same class;
the command-line entry point is `titanlite.train`.
"""

from __future__ import annotations

import gc
import logging
import os
import random
import time

import torch
import torch.distributed as dist

from titanlite.checkpoint.lock import DumpFolderLock, run_folders
from titanlite.checkpoint.manager import CheckpointManager
from titanlite.config import JobConfig
from titanlite.errors import DumpFolderInUse, RunNotSaved, TrainingDiverged
from titanlite.fault_tolerance.data_states import GroupLoaderStates
from titanlite.fault_tolerance.replica_group import ReplicaGroup
from titanlite.faults import StepFaults
from titanlite.metrics import METRICS, MetricsLogger, StepStats
from titanlite.metrics.goodput_clock import GoodputClock
from titanlite.metrics.profiling import Profiler
from titanlite.metrics.runs import layout_label
from titanlite.metrics.straggler import StragglerMeter
from titanlite.parallelisms.step_context import StepContext
from titanlite.planning.run_plan import RunPlan, describe_shape
from titanlite.run import socket_interfaces
from titanlite.run.build import (
    apply_train_timeout,
    build_training,
    init_device,
    init_distributed,
    rank_compile_cache,
    world_from_env,
)
from titanlite.run.loader import build_loader
from titanlite.run.optimizer import build_lr_scheduler, build_optimizer
from titanlite.run.progress import Progress
from titanlite.run.rank_exit import LAUNCHER_PID_ENV
from titanlite.run.rank_logging import init_logging
from titanlite.run.replica_batches import replica_batches
from titanlite.run.replica_state import ReplicaState
from titanlite.run.resilience import StepVerdict, agree, stop_agreed
from titanlite.run.signals import Preemption
from titanlite.run.validation import Validator

logger = logging.getLogger("titanlite")
FAMILY_METRICS = tuple(m.name for m in METRICS if m.family)


def lock_run_folders(cfg: JobConfig, rank: int) -> list[DumpFolderLock]:
    """One run at a time per dump folder (and checkpoint folder outside it): rank 0 holds their locks from
    before anything is written there until `Trainer.close`; a folder in use releases those already held."""
    held: list[DumpFolderLock] = []
    if rank != 0:
        return held
    ckpt = cfg.checkpoint
    try:
        for key, folder in run_folders(cfg.job.dump_folder, ckpt.folder if ckpt.enable else None).items():
            held.append(DumpFolderLock(folder, key))
    except DumpFolderInUse:
        for lock in held:
            lock.release()
        raise
    return held


def seed_everything(seed: int, deterministic: bool) -> None:
    """Python's and torch's generators from `training.seed`; `training.deterministic` asks torch for
    deterministic kernels (cuBLAS's among them)."""
    random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=False)
        torch.backends.cudnn.benchmark = False
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


class Trainer:
    """Builds every component from the config and runs the step loop.

    `plan` replaces the one built from `cfg` (tests train tiny models through this same trainer). A
    process group that exists already is used and left open by `close()`. `preemption` is the stop-signal
    recorder `main` installs before anything is built, so a signal during set-up is not lost.
    """

    def __init__(self, cfg: JobConfig, plan: RunPlan | None = None, preemption: Preemption | None = None):
        self.cfg = cfg
        self.rank, self.world_size = world_from_env()
        self.seed_only = cfg.checkpoint.create_seed_checkpoint
        """A seed checkpoint is one process holding the whole unsharded model (70B in fp32: 280 GB): it is
        built in host memory, never on a GPU, and needs no data."""
        self.device = torch.device("cpu") if self.seed_only else init_device()
        rank_compile_cache(os.environ, self.rank)
        init_logging(self.rank)
        self.folder_locks = lock_run_folders(cfg, self.rank)
        self.goodput = GoodputClock(cfg.job.dump_folder, enabled=self.rank == 0)
        """Where this process's time goes (the goodput ledger, rank 0's part); from the attempt's start."""
        seed_everything(cfg.training.seed, cfg.training.deterministic)
        self._adopt_plan(plan or RunPlan.build(cfg, self.world_size))
        self._build_data()
        self._join_process_group()
        self._build_model()
        self._log_run()
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self._init_loop_state(preemption)
        self.checkpointer = self._build_checkpointer()
        self.replicas = self._join_replica_groups()
        self.metrics = self._build_metrics()

    def stopping(self) -> bool:
        """Whether a stop signal ends the run: received by this rank, or agreed with the rank that did."""
        return self.preempted or self.preemption.received is not None

    # --- set-up, in the order of __init__ ---------------------------------------------------------------

    def _adopt_plan(self, plan: RunPlan) -> None:
        """The run plan, and the facts of it the loop reads most."""
        self.plan = plan
        self.model_args, self.dims = plan.model_args, plan.dims
        self.global_batch, self.grad_accum = plan.global_batch, plan.grad_accum

    def _build_data(self) -> None:
        """The training and held-out loaders of this rank's replica (none for a seed checkpoint). Built
        before the process group: a bad dataset path is reported before any rank starts work; under the
        launcher its preflight has reported on the data already."""
        dp_rank = self.dims.dp_rank_of(self.rank)
        report = not os.environ.get(LAUNCHER_PID_ENV)
        self.dataloader = None if self.seed_only else build_loader(self.plan, dp_rank, self.device.type, report)
        self.validator = None if self.seed_only else Validator.create(self.plan, dp_rank)
        ft = self.cfg.fault_tolerance
        self.loader_states = GroupLoaderStates(self.dataloader, ft.replica_id) if ft.enable else None
        """A replica group's loader with every group's position: what its checkpoints save and a peer receives."""

    def _join_process_group(self) -> None:
        """The process group (one that exists already is used and left open), after rank 0 has named the
        network interfaces it uses; then the straggler meter, which measures over it."""
        self._owns_process_group = not dist.is_initialized()
        if self.rank == 0 and (network := socket_interfaces.describe(os.environ)):
            logger.info(network)
        init_distributed(self.cfg, self.device)
        self.stragglers = StragglerMeter(self.cfg.metrics.straggler_threshold, self.device)

    def _build_model(self) -> None:
        """The model, parallelized and initialised, in training mode; with pipeline parallelism it is this
        rank's stages (one module with the model's names)."""
        training = build_training(self.plan, self.device)
        self.runner, self.model = training.runner, training.model
        """The step runner (`step.StepRunner`): the only way the trainer and the validator call the model."""
        self.step_choice = training.step_choice
        """The step policy (`build.choose_step_policy`): reduction per step or per microbatch, gathers kept."""
        self.reduce_once = self.runner.context.reduce_once
        self.keep_gathers = self.runner.context.keep_gathers
        self.model.train()

    def _log_run(self) -> None:
        """The run in three lines at most: the model, the mesh and the batch; the plan; the pipeline."""
        cfg, args = self.cfg, self.model_args
        n_params, shape = args.num_params(), describe_shape(self.plan.spec, args)
        split = self.dims.describe_batch(f"local {cfg.training.local_batch_size}", self.grad_accum)
        logger.info(
            f"model {cfg.model.name} {cfg.model.flavor} ({shape}): {n_params:,} parameters, "
            f"vocab {args.vocab_size}; "
            f"{self.dims.describe()}; "
            f"global batch {self.global_batch} = {split}"
        )
        logger.info(f"plan: {self.plan.describe(self.step_choice)}")
        if self.plan.pipeline is not None:
            logger.info(self.plan.pipeline.describe())

    def _init_loop_state(self, preemption: Preemption | None) -> None:
        """What the loop keeps between steps: the step, the skipped steps, the last verdict, the stop
        signals and the progress the launcher's hang watchdog reads."""
        self.step = 0
        self.skipped_steps = 0
        self.verdict: StepVerdict | None = None
        """The last step's agreement: stop signal, finite, and the logged loss and grad norm."""
        self.preemption = preemption or Preemption()
        self.preempted = False
        self.progress = Progress(self.rank)
        """What the launcher's hang watchdog reads: each finished step, and the phases that may outlast one."""
        self.committed = True
        """Whether the last step was applied: a replica group's step that its quorum did not commit is retried."""

    def _build_checkpointer(self) -> CheckpointManager:
        return CheckpointManager(
            self.plan,
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            dataloader=self.loader_states or self.dataloader,
            rank=self.rank,
            device=self.device,
            stopping=self.stopping,
        )

    def _join_replica_groups(self) -> ReplicaGroup | None:
        """This run as replica group `fault_tolerance.replica_id` of the job (`fault_tolerance.enable`), whose
        torchft manager this rank joins; None for a run of its own."""
        ft = self.cfg.fault_tolerance
        if not ft.enable:
            return None
        state = ReplicaState(self.checkpointer.state, self.loader_states, self.plan, lambda: self.step)
        return ReplicaGroup(ft, self.loader_states, state.capture, state.restore, self.device)

    def _build_metrics(self) -> MetricsLogger:
        cfg, t = self.cfg, self.cfg.training
        return MetricsLogger(
            cfg.metrics,
            cfg.job.dump_folder,
            self.device,
            flops_per_token=self.model_args.flops_per_token(t.seq_len),
            enabled=self.rank == 0,
            run_config=cfg.to_dict(),
            validation=self.validator is not None,
            stragglers=self.stragglers.own is not None,
            family_metrics=FAMILY_METRICS if self.plan.spec.hooks.step_metrics is not None else (),
            run_label=layout_label(
                self.dims.mesh_degrees, cfg.parallelism.dp_impl, cfg.compile.enable, self.dims.experts_label
            ),
            world_size=self.world_size,
            compiled=cfg.compile.enable,
            sources=tuple(source.name for source in t.datasets),
            replicas=self.replicas is not None,
        )

    # --- the step ---------------------------------------------------------------------------------------

    def train_step(
        self, batches: list[tuple[torch.Tensor, torch.Tensor]], context: StepContext | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradients, agreement across ranks (and a replica group's commit across groups: `self.committed`),
        then the optimizer step unless the step is not finite or not committed; `context` replaces the
        runner's for this step.

        One host sync: the agreement's single read (`resilience.agree`), which also brings the logged
        loss and grad norm to the host (`self.verdict`); nothing else in the step waits for the device."""
        loss, grad_norm = self.runner.forward_backward(self.optimizer, batches, context)
        self.verdict = agree(self.preemption, loss, grad_norm, self.device)
        self.preempted = self.verdict.preempted
        if self.replicas is not None:
            self.committed = self.replicas.commit(self.replicas.exchange_data())
            if not self.committed:
                self.optimizer.zero_grad(set_to_none=True)
                return loss, grad_norm
        if self.verdict.finite:
            self.optimizer.step()
            self.lr_scheduler.step()
            if self.plan.spec.hooks.after_step is not None:
                self.plan.spec.hooks.after_step(self.model)
        else:
            self._on_nonfinite(self.verdict)
        return loss, grad_norm

    def _on_nonfinite(self, verdict: StepVerdict) -> None:
        """Skip the update (up to `training.skip_nonfinite_steps` times), else stop with the facts."""
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped_steps += 1
        limit = self.cfg.training.skip_nonfinite_steps
        what = f"step {self.step}: loss {verdict.loss:.4g}, grad norm {verdict.grad_norm:.4g}"
        if self.skipped_steps > limit:
            last = self.checkpointer.last_complete() or "none"
            raise TrainingDiverged(
                f"non-finite {what} (skipped {self.skipped_steps - 1} of at most {limit}); last good checkpoint: {last}"
            )
        logger.warning(f"non-finite {what}; update skipped ({self.skipped_steps} of at most {limit})")

    def train(self) -> None:
        """The seed checkpoint, or the resume and the loop up to `training.steps` (`_loop`)."""
        cfg = self.cfg.training
        if self.cfg.checkpoint.create_seed_checkpoint:
            self.goodput.mark("startup")
            self.checkpointer.save(0, force=True, model_only=True)
            self.checkpointer.close()
            self.goodput.mark("checkpoint_save")
            logger.info("seed checkpoint written; exiting")
            return
        self.goodput.mark("startup")
        self.step = start = self.checkpointer.load()
        self.goodput.mark("checkpoint_load")
        if self.replicas is not None:
            self.replicas.resume_at(self.step)
        if stop_agreed(self.preemption, self.device):  # signalled while starting: nothing trained
            self.preempted = True
            since = f" since the checkpoint of step {start}" if start else ""
            logger.info(
                f"stop signal ({self.preemption.name or 'a peer'}) before the first step: "
                f"nothing trained{since}, nothing to save; exiting"
            )
            return
        if self.step >= cfg.steps:
            logger.info(
                f"nothing to train: resumed at step {self.step}, training.steps is {cfg.steps} "
                "(raise training.steps to train on)"
            )
            return
        data_iter = self._batches()
        gc.disable()
        try:
            self._loop(data_iter, start)
        finally:
            gc.enable()

    def _loop(self, data_iter, start: int) -> None:
        cfg = self.cfg.training
        gc.collect(1)
        window_start, window_data, window_steps = time.perf_counter(), 0.0, 0
        tokens_per_step = self.plan.tokens_per_gpu_step
        step_metrics = self.plan.spec.hooks.step_metrics
        logger.info(f"training {cfg.steps} steps from step {self.step + 1}")
        self.metrics.begin(self.step, cfg.steps)
        self.stragglers.restart()
        self.goodput.mark("startup")
        self.goodput.flush()
        first_step = self.step + 1  # of this process: after a resume or a restart too
        faults = StepFaults.from_env(self.rank)
        retry: list | None = None  # a replica group's step that did not commit, trained again on its batches
        with Profiler(self.cfg.profiling, self.cfg.job.dump_folder, self.rank, self.device, self.step) as profiler:
            while self.step < cfg.steps:
                if self.replicas is not None and (healed := self.replicas.start_step(self.step)) is not None:
                    data_iter, retry = self._rejoined(healed), None
                    if self.step >= cfg.steps:
                        break
                self.step += 1
                faults.before_step(self.step)
                t0 = self.goodput.mark("other")
                batches = retry or [next(data_iter) for _ in range(self.grad_accum)]
                window_data += self.goodput.mark("data_wait") - t0
                self.train_step(batches, self._step_context(faults))
                if not self.committed:
                    assert self.replicas is not None
                    cause = self.replicas.last_error or "another group failed or was late"
                    logger.warning(f"step {self.step} not committed by the replica groups ({cause}): training it again")
                    self.step, retry = self.step - 1, batches
                    self.goodput.mark("recompute")
                    continue
                retry = None
                self.goodput.step_done(self.step)
                self.progress.beat(self.step)
                profiler.step()
                window_steps += 1
                if self.step == first_step:  # compiled: a dead peer now surfaces within the train timeout
                    apply_train_timeout(self.cfg, self.dims)
                log_now = self.step % self.cfg.metrics.log_freq == 0 or self.step in (1, cfg.steps)
                if log_now or self.preempted:
                    elapsed = time.perf_counter() - window_start
                    straggler = self.stragglers.measure(window_steps, self.step)
                    self.metrics.log(
                        StepStats(
                            step=self.step,
                            loss=self.verdict.loss,
                            grad_norm=self.verdict.grad_norm,
                            lr=self.lr_scheduler.get_last_lr()[0],
                            tokens=tokens_per_step * window_steps,
                            elapsed=elapsed,
                            data_time=window_data,
                            family=step_metrics(self.model) if step_metrics else {},
                            tokens_seen=self.dataloader.dataset.tokens_seen(self.step - start),
                            straggler=straggler.metrics() if straggler else {},
                            goodput=self.goodput.metrics(),
                            replicas=self.replicas.metrics(self.model, self.step) if self.replicas is not None else {},
                        ),
                        window_steps,
                    )
                    self.goodput.flush()
                    window_start, window_data, window_steps = time.perf_counter(), 0.0, 0
                if self.validator is not None and self.validator.due(self.step):
                    self.progress.beat(self.step, "validation")
                    result = self.validator.run(self.runner)
                    self.metrics.log_validation(self.step, result)
                    window_start += result.seconds  # not training time: kept out of tokens/s
                if self.preempted:
                    self._save_and_stop(start)
                    return
                last_step = self.step == cfg.steps
                if self.checkpointer.due(self.step, last_step):
                    self.progress.beat(self.step, "checkpoint")
                self.goodput.mark("other")
                if self.replicas is None or self.replicas.saves_checkpoints():
                    self.checkpointer.save(self.step, last_step=last_step)
                self.goodput.mark("checkpoint_save")
                self.progress.beat(self.step)
                if cfg.gc_freq and self.step % cfg.gc_freq == 0:
                    gc.collect(1)
        if self.cfg.checkpoint.enable:
            self.goodput.mark("other")
            self.checkpointer.confirm(self.step, f"training finished at step {self.step}")
            self.goodput.mark("checkpoint_save")
        logger.info("training finished")

    def _step_context(self, faults: StepFaults) -> StepContext:
        """The runner's context for this step: a replica group's averages its gradients over the groups; its
        loss made NaN at a step the tests' faults name."""
        context = self.runner.context
        if self.replicas is not None:
            context = context.with_replicas(self.replicas.average)
        loss_fn = faults.nan_loss(self.step, context.loss_fn)
        return context if loss_fn is context.loss_fn else context.with_loss(loss_fn)

    def _rejoined(self, step: int):
        """This replica group received the state of step `step` from a live group (model, optimizer, schedule
        and its own data position): it continues from there, with its loader's iterator started anew."""
        assert self.replicas is not None
        missed = self.replicas.missed_steps(step)
        logger.info(
            f"replica group {self.cfg.fault_tolerance.replica_id} rejoined at step {step}: received the state of "
            f"a live group (the job has trained {missed} of its steps without this group)"
        )
        self.goodput.missed(missed)
        self.goodput.mark("restart")
        self.step = step
        return self._batches()

    def _batches(self):
        """This rank's batches from where its loader is: one rank of each data-parallel replica reads, its
        other ranks receive them (`replica_batches`)."""
        t = self.cfg.training
        shape, timeout = (t.local_batch_size, t.seq_len), self.cfg.comm.init_timeout_seconds
        return replica_batches(self.dataloader, self.dims, self.device, shape, timeout)

    def _save_and_stop(self, start: int) -> None:
        """All ranks agreed on a stop signal: checkpoint this step, wait for it, and end the run cleanly;
        `RunNotSaved` (exit code 4) when the save failed or checkpointing is off."""
        what = f"stop signal ({self.preemption.name or 'a peer'}) at step {self.step}"
        if not self.cfg.checkpoint.enable:
            raise RunNotSaved(
                f"{what}: nothing saved (checkpoint.enable = false): the {self.step - start} steps this run "
                "trained are lost (--checkpoint.enable saves them at a stop signal, and the next launch resumes)"
            )
        self.progress.beat(self.step, "checkpoint")
        self.goodput.mark("other")
        self.checkpointer.save(self.step, force=True)
        saved = self.checkpointer.confirm(self.step, what)
        self.goodput.mark("checkpoint_save")
        logger.info(f"{what}: checkpoint saved to {saved}; exiting")

    def close(self) -> None:
        """Ends the run's outputs; the goodput ledger's last row, last (before the dump folder is free)."""
        if self.replicas is not None:
            self.replicas.close()
        self.progress.close()
        self.stragglers.close()
        self.goodput.mark("other")
        self.checkpointer.close()  # an async save in flight, deletions: the end waits for them
        self.goodput.mark("checkpoint_save")
        self.metrics.close()
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self.goodput.mark("other")
        self.goodput.flush()
        for held in self.folder_locks:
            held.release()
