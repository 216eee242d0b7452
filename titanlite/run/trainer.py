"""The Trainer: builds a run from its config (through `titanlite.run.build`) and runs the step loop.

`Trainer.train_step` is the one training step (gradients, agreement across ranks on stop signals and
non-finite values, the optimizer and LR-schedule step); the loop in `Trainer.train` adds data, metrics,
profiling and checkpoints around it. Tests and benchmarks drive this same class; the command-line entry
point is `titanlite.train`.
"""

from __future__ import annotations

import gc
import logging
import os
import random
import time

import torch
import torch.distributed as dist

from titanlite import faults
from titanlite.checkpoint.lock import DumpFolderLock, run_folders
from titanlite.checkpoint.manager import CheckpointManager
from titanlite.config import JobConfig
from titanlite.errors import DumpFolderInUse, RunNotSaved, TrainingDiverged
from titanlite.metrics import METRICS, MetricsLogger, StepStats
from titanlite.metrics.goodput_clock import GoodputClock
from titanlite.metrics.profiling import Profiler
from titanlite.metrics.runs import layout_label
from titanlite.metrics.straggler import StragglerMeter
from titanlite.parallelisms.data_parallel.replica_batches import replica_batches
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
from titanlite.run.resilience import StepVerdict, agree, stop_agreed
from titanlite.run.signals import Preemption
from titanlite.run.validation import Validator

logger = logging.getLogger("titanlite")
FAMILY_METRICS = tuple(m.name for m in METRICS if m.family)


class _UnactionableTorchAdvice(logging.Filter):
    """Drops DTensor's advice that a redistribution runs one collective per mesh dim ("While
    redistributing from ... sequential ... operations"), which torch logs once per mesh for the gradient
    norm of a tensor-parallel run (a `_NormPartial` reduced over dp and tp): the user can do nothing about
    it, and its "may give inconsistent results between ranks" reads like a fault. Every other record of
    that logger passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("While redistributing from")


REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"


def init_logging(rank: int) -> None:
    """One stderr handler on the `titanlite` logger (replaced, not added, when a process builds several
    trainers); records still propagate, so handlers on the root logger see them too. Under the launcher,
    which starts each line with `[rank<r>]: `, the lines do not name the rank a second time."""
    for handler in [h for h in logger.handlers if getattr(h, "titanlite", False)]:
        logger.removeHandler(handler)
    handler = logging.StreamHandler()
    prefix = "" if os.environ.get(LAUNCHER_PID_ENV) else f"[titanlite rank{rank}] "
    handler.setFormatter(logging.Formatter(f"{prefix}%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S"))
    handler.titanlite = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    torch_logger = logging.getLogger(REDISTRIBUTE_LOGGER)
    if not any(isinstance(f, _UnactionableTorchAdvice) for f in torch_logger.filters):
        torch_logger.addFilter(_UnactionableTorchAdvice())


class Trainer:
    """Builds every component from the config and runs the step loop.

    `plan` replaces the one built from `cfg` (tests train tiny models through this same trainer). A
    process group that exists already is used and left open by `close()`. `preemption` is the stop-signal
    recorder `main` installs before anything is built, so a signal during set-up is not lost.
    """

    def __init__(self, cfg: JobConfig, plan: RunPlan | None = None, preemption: Preemption | None = None):
        self.cfg = cfg
        self.rank, self.world_size = world_from_env()
        # A seed checkpoint is one process holding the whole unsharded model (70B in fp32: 280 GB): it is
        # built in host memory, never on a GPU, and needs no data.
        self.seed_only = cfg.checkpoint.create_seed_checkpoint
        self.device = torch.device("cpu") if self.seed_only else init_device()
        rank_compile_cache(os.environ, self.rank)
        init_logging(self.rank)
        # One run at a time per dump folder (and checkpoint folder outside it), held from before anything is
        # written there until close().
        self.folder_locks: list[DumpFolderLock] = []
        if self.rank == 0:
            ckpt = cfg.checkpoint
            try:
                for key, folder in run_folders(cfg.job.dump_folder, ckpt.folder if ckpt.enable else None).items():
                    self.folder_locks.append(DumpFolderLock(folder, key))
            except DumpFolderInUse:
                for held in self.folder_locks:
                    held.release()
                raise
        self.goodput = GoodputClock(cfg.job.dump_folder, enabled=self.rank == 0)
        """Where this process's time goes (the goodput ledger, rank 0's part); from the attempt's start."""
        self._seed(cfg.training.seed, cfg.training.deterministic)

        self.plan = plan or RunPlan.build(cfg, self.world_size)
        self.tokenizer, self.model_args, self.dims = self.plan.tokenizer, self.plan.model_args, self.plan.dims
        self.global_batch, self.grad_accum = self.plan.global_batch, self.plan.grad_accum
        t = cfg.training
        # Built before the process group: a bad dataset path is reported before any rank starts work.
        dp_rank = self.dims.dp_rank_of(self.rank)
        # Under the launcher its preflight has reported on the data already.
        report = not os.environ.get(LAUNCHER_PID_ENV)
        self.dataloader = None if self.seed_only else build_loader(self.plan, dp_rank, self.device.type, report)
        self.validator = None if self.seed_only else Validator.create(self.plan, dp_rank)

        self._owns_process_group = not dist.is_initialized()
        if self.rank == 0 and (network := socket_interfaces.describe(os.environ)):
            logger.info(network)
        init_distributed(cfg, self.device)
        self.stragglers = StragglerMeter(cfg.metrics.straggler_threshold, self.device)
        # With pipeline parallelism the model is this rank's stages (one module with the model's names).
        training = build_training(self.plan, self.device)
        self.runner, self.model = training.runner, training.model
        """The step runner (`step.StepRunner`): the only way the trainer and the validator call the model."""
        self.step_choice = training.step_choice
        """The step policy (`build.choose_step_policy`): reduction per step or per microbatch, gathers kept."""
        self.reduce_once = self.runner.context.reduce_once
        self.keep_gathers = self.runner.context.keep_gathers
        self.model.train()
        n_params, shape = self.model_args.num_params(), describe_shape(self.plan.spec, self.model_args)
        split = self.dims.describe_batch(f"local {t.local_batch_size}", self.grad_accum)
        logger.info(
            f"model {cfg.model.name} {cfg.model.flavor} ({shape}): {n_params:,} parameters, "
            f"vocab {self.model_args.vocab_size}; "
            f"{self.dims.describe()}; "
            f"global batch {self.global_batch} = {split}"
        )
        logger.info(f"plan: {self.plan.describe(self.step_choice)}")
        if self.plan.pipeline is not None:
            logger.info(self.plan.pipeline.describe())

        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, t.steps)
        self.step = 0
        self.skipped_steps = 0
        self.verdict: StepVerdict | None = None
        """The last step's agreement: stop signal, finite, and the logged loss and grad norm."""
        self.preemption = preemption or Preemption()
        self.preempted = False
        self.progress = Progress(self.rank)
        """What the launcher's hang watchdog reads: each finished step, and the phases that may outlast one."""
        self.checkpointer = CheckpointManager(
            self.plan,
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            dataloader=self.dataloader,
            rank=self.rank,
            device=self.device,
            stopping=self.stopping,
        )
        self.metrics = MetricsLogger(
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
        )

    def stopping(self) -> bool:
        """Whether a stop signal ends the run: received by this rank, or agreed with the rank that did."""
        return self.preempted or self.preemption.received is not None

    # --- set-up helpers ---------------------------------------------------------------------------------

    def _set_train_timeout(self) -> None:
        """After the first step this process runs (which includes compilation; step 1, or the first after
        a resume or an elastic restart), a dead peer must surface within the train timeout, on every
        process group the step uses."""
        apply_train_timeout(self.cfg, self.dims)

    @staticmethod
    def _seed(seed: int, deterministic: bool) -> None:
        random.seed(seed)
        torch.manual_seed(seed)
        if deterministic:
            torch.use_deterministic_algorithms(True, warn_only=False)
            torch.backends.cudnn.benchmark = False
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    # --- the step ---------------------------------------------------------------------------------------

    def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradients, agreement across ranks, then the optimizer step unless the step is not finite.

        One host sync: the agreement's single read (`resilience.agree`), which also brings the logged
        loss and grad norm to the host (`self.verdict`); nothing else in the step waits for the device."""
        context = self.runner.context
        if faults.nan_loss_at(self.step):
            loss_fn = context.loss_fn
            context = context.with_loss(lambda pred, labels: loss_fn(pred, labels) * float("nan"))
        loss, grad_norm = self.runner.forward_backward(self.optimizer, batches, context)
        self.verdict = agree(self.preemption, loss, grad_norm, self.device)
        self.preempted = self.verdict.preempted
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
        t = self.cfg.training
        # One rank of each data-parallel replica reads; its other ranks receive its batches.
        shape, timeout = (t.local_batch_size, t.seq_len), self.cfg.comm.init_timeout_seconds
        data_iter = replica_batches(self.dataloader, self.dims, self.device, shape, timeout)
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
        with Profiler(self.cfg.profiling, self.cfg.job.dump_folder, self.rank, self.device, self.step) as profiler:
            while self.step < cfg.steps:
                self.step += 1
                faults.before_step(self.step, self.rank)
                t0 = self.goodput.mark("other")
                batches = [next(data_iter) for _ in range(self.grad_accum)]
                window_data += self.goodput.mark("data_wait") - t0
                self.train_step(batches)
                self.goodput.step_done(self.step)
                self.progress.beat(self.step)
                profiler.step()
                window_steps += 1
                if self.step == first_step:
                    self._set_train_timeout()
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
