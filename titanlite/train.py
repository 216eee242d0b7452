"""The training entry point: `python -m titanlite.train --config FILE [--section.key value ...]`.

The data path reads top to bottom: config -> process group and ParallelDims (mesh) -> tokenizer and
model on the meta device -> parallelize plan -> materialise and initialise -> optimizer, LR schedule,
dataloader -> step loop -> metrics. Bad input (config, data, checkpoints) is a `UserError`: one line on
stderr and exit code 2.
"""

from __future__ import annotations

import gc
import logging
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from titanlite.checkpoint.manager import CheckpointManager
from titanlite.config import JobConfig, load_config
from titanlite.data.loader import build_dataloader
from titanlite.data.tokenizer import Tokenizer, build_tokenizer
from titanlite.errors import ConfigError, TrainingDiverged, UserError
from titanlite.metrics import MetricsLogger, StepStats
from titanlite.models.llama3 import ModelArgs, Transformer, llama3_configs
from titanlite.models.llama3.parallelize import parallelize_llama
from titanlite.optim import build_lr_scheduler, build_optimizer
from titanlite.parallelisms.parallel_dims import ParallelDims
from titanlite.profiling import Profiler
from titanlite.resilience import Preemption, agree, inject_before_step, nan_injection
from titanlite.step import cross_entropy_loss, forward_backward

logger = logging.getLogger("titanlite")
DEFAULT_CONFIG = "train_configs/debug_model.toml"


def init_logging(rank: int) -> None:
    logging.basicConfig(format=f"[titanlite rank{rank}] %(asctime)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S", level=logging.INFO, force=True)


def model_args(cfg: JobConfig, vocab_size: int):
    if cfg.model.name != "llama3":
        raise ConfigError(f"config key 'model.name' = {cfg.model.name!r}: expected llama3")
    if cfg.model.flavor not in llama3_configs:
        raise ConfigError(
            f"config key 'model.flavor' = {cfg.model.flavor!r}: expected one of {', '.join(llama3_configs)}"
        )
    args = llama3_configs[cfg.model.flavor]
    if cfg.training.seq_len > args.max_seq_len:
        raise ConfigError(
            f"training.seq_len {cfg.training.seq_len} exceeds the {cfg.model.flavor} model's max_seq_len {args.max_seq_len}"
        )
    args = type(args)(**{**args.__dict__, "vocab_size": vocab_size})
    return args


@dataclass
class RunPlan:
    """Everything derived from the config and world size alone: checked before any rank does work."""

    tokenizer: Tokenizer
    model_args: ModelArgs
    dims: ParallelDims
    global_batch: int
    grad_accum: int

    @classmethod
    def build(cls, cfg: JobConfig, world_size: int) -> "RunPlan":
        tokenizer = build_tokenizer(cfg.model.tokenizer_path or None)
        args = model_args(cfg, tokenizer.n_words)
        p, t = cfg.parallelism, cfg.training
        dims = ParallelDims(
            dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
            tp=p.tensor_parallel_degree, world_size=world_size, n_heads=args.n_heads,
            n_kv_heads=args.kv_heads, dp_impl=p.dp_impl,
        )
        global_batch = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dims.dp
        if global_batch % (t.local_batch_size * dims.dp):
            raise ConfigError(
                f"training.global_batch_size {global_batch} is not a multiple of "
                f"local_batch_size {t.local_batch_size} x data-parallel degree {dims.dp}"
            )
        return cls(tokenizer, args, dims, global_batch, global_batch // (t.local_batch_size * dims.dp))


class Trainer:
    """Builds every component from the config and runs the step loop."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.device = self._init_device()
        init_logging(self.rank)
        if cfg.job.print_config and self.rank == 0:
            print(cfg.to_json(), flush=True)
        self._seed(cfg.training.seed, cfg.training.deterministic)

        plan = RunPlan.build(cfg, self.world_size)
        self.tokenizer, self.model_args, self.dims = plan.tokenizer, plan.model_args, plan.dims
        self.global_batch, self.grad_accum = plan.global_batch, plan.grad_accum
        t, dp = cfg.training, self.dims.dp
        # Built before the process group: a bad dataset path is reported before any rank starts work.
        self.dataloader = build_dataloader(
            tokenizer=self.tokenizer, dataset_path=t.dataset_path, text_field=t.dataset_text_field,
            seq_len=t.seq_len, local_batch_size=t.local_batch_size, global_batch_size=self.global_batch,
            dp_rank=self._dp_rank_from_env(), dp_degree=dp, virtual_shards=t.dataset_virtual_shards,
            num_workers=t.dataloader_num_workers,
        )

        self._init_process_group()
        self.mesh = self.dims.build_mesh(self.device.type) if self.world_size > 1 else None

        with torch.device("meta"):
            model = Transformer(self.model_args, seq_len=t.seq_len)
        if self.mesh is not None:
            model = parallelize_llama(model, self.dims, cfg)
        model.to_empty(device=self.device)
        model.init_weights(seed=t.seed, buffer_device=self.device)
        model.train()
        self.model = model
        n_params = self.model_args.num_params()
        logger.info(
            f"model llama3 {cfg.model.flavor}: {n_params:,} parameters, vocab {self.model_args.vocab_size}; "
            f"mesh {dict(zip(self.dims.dim_names, [getattr(self.dims, n) for n in self.dims.dim_names]))} "
            f"({cfg.parallelism.dp_impl}, {self.dims.dp_mode if self.dims.dp_enabled else 'no dp'}); "
            f"global batch {self.global_batch} = local {t.local_batch_size} x dp {dp} x accum {self.grad_accum}"
        )

        self.optimizer = build_optimizer(model, cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, t.steps)
        self.loss_fn = cross_entropy_loss
        if cfg.compile.enable and "loss" in cfg.compile.components:
            self.loss_fn = torch.compile(cross_entropy_loss, backend=cfg.compile.backend)
        self.loss_parallel = self.dims.tp_enabled and not cfg.parallelism.disable_loss_parallel
        self.step = 0
        self.skipped_steps = 0
        self.preemption = Preemption()
        self.preempted = False
        self.checkpointer = CheckpointManager(
            cfg, model=model, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler, dataloader=self.dataloader,
            dims=self.dims, rank=self.rank, world_size=self.world_size, device=self.device,
        )
        self.metrics = MetricsLogger(
            cfg.metrics, cfg.job.dump_folder, self.device,
            flops_per_token=self.model_args.flops_per_token(t.seq_len), enabled=self.rank == 0,
        )

    # --- set-up helpers ---------------------------------------------------------------------------------

    def _init_device(self) -> torch.device:
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
            return device
        return torch.device("cpu")

    def _dp_rank_from_env(self) -> int:
        """This rank's index on the flattened dp mesh: ranks are laid out (dp_replicate, dp_shard, tp)."""
        return self.rank // self.dims.tp

    def _init_process_group(self) -> None:
        if self.world_size == 1 and "MASTER_ADDR" not in os.environ:
            return
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=self.cfg.comm.init_timeout_seconds)
        # torchrun keeps one store across restarts; without a per-attempt prefix a restarted rank can read
        # the previous attempt's peer addresses and fail to connect.
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"titanlite/attempt{attempt}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)

    def _set_train_timeout(self) -> None:
        """After the first step (which includes compilation), a dead peer must surface within the train timeout."""
        if dist.is_initialized():
            timeout = timedelta(seconds=self.cfg.comm.train_timeout_seconds)
            dist.distributed_c10d._set_pg_timeout(timeout, None)

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
        """Gradients, agreement across ranks, then the optimizer step unless the step is not finite."""
        loss_fn = self.loss_fn
        if nan_injection(self.step):
            loss_fn = lambda pred, labels: self.loss_fn(pred, labels) * float("nan")  # noqa: E731
        loss, grad_norm = forward_backward(self.model, self.optimizer, batches, loss_fn, self.loss_parallel,
                                           self.cfg.training.max_norm, self.device)
        verdict = agree(self.preemption, loss, grad_norm, self.device)
        self.preempted = verdict.preempted
        if verdict.finite:
            self.optimizer.step()
            self.lr_scheduler.step()
        else:
            self._on_nonfinite(loss, grad_norm)
        return loss, grad_norm

    def _on_nonfinite(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Skip the update (up to `training.skip_nonfinite_steps` times), else stop with the facts."""
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped_steps += 1
        limit = self.cfg.training.skip_nonfinite_steps
        what = f"step {self.step}: loss {loss.item():.4g}, grad norm {grad_norm.item():.4g}"
        if self.skipped_steps > limit:
            last = self.checkpointer.last_complete() or "none"
            raise TrainingDiverged(
                f"non-finite {what} (skipped {self.skipped_steps - 1} of at most {limit}); "
                f"last good checkpoint: {last}"
            )
        logger.warning(f"non-finite {what}; update skipped ({self.skipped_steps} of at most {limit})")

    def _global_mean(self, value: torch.Tensor) -> float:
        """Average a per-rank loss over the data-parallel mesh (tp ranks hold the same value)."""
        mesh = self.dims.dp_mesh if self.mesh is not None else None
        if mesh is None:
            return value.item()
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.AVG, group=mesh.get_group())
        return value.item()

    def train(self) -> None:
        cfg = self.cfg.training
        if self.cfg.checkpoint.create_seed_checkpoint:
            self.checkpointer.save(0, force=True, model_only=True)
            self.checkpointer.close()
            logger.info("seed checkpoint written; exiting")
            return
        self.step = self.checkpointer.load()
        data_iter = iter(self.dataloader)
        gc.disable()
        gc.collect(1)
        window_start, window_data, window_steps = time.perf_counter(), 0.0, 0
        tokens_per_step = cfg.local_batch_size * cfg.seq_len * self.grad_accum
        logger.info(f"training {cfg.steps} steps from step {self.step + 1}")
        with Profiler(self.cfg.profiling, self.cfg.job.dump_folder, self.rank, self.device, self.step) as profiler:
            while self.step < cfg.steps:
                self.step += 1
                inject_before_step(self.step, self.rank)
                t0 = time.perf_counter()
                batches = [next(data_iter) for _ in range(self.grad_accum)]
                window_data += time.perf_counter() - t0
                loss, grad_norm = self.train_step(batches)
                profiler.step()
                window_steps += 1
                if self.step == 1:
                    self._set_train_timeout()
                log_now = self.step % self.cfg.metrics.log_freq == 0 or self.step in (1, cfg.steps)
                if log_now or self.preempted:
                    elapsed = time.perf_counter() - window_start
                    self.metrics.log(StepStats(
                        step=self.step, loss=self._global_mean(loss), grad_norm=grad_norm.item(),
                        lr=self.lr_scheduler.get_last_lr()[0], tokens=tokens_per_step * window_steps,
                        elapsed=elapsed, data_time=window_data,
                    ), window_steps)
                    window_start, window_data, window_steps = time.perf_counter(), 0.0, 0
                if self.preempted:
                    self._save_and_stop()
                    return
                self.checkpointer.save(self.step, last_step=self.step == cfg.steps)
                if cfg.gc_freq and self.step % cfg.gc_freq == 0:
                    gc.collect(1)
        gc.enable()
        logger.info("training finished")

    def _save_and_stop(self) -> None:
        """All ranks agreed on a stop signal: checkpoint this step, wait for it, and end the run cleanly."""
        self.checkpointer.save(self.step, force=True)
        self.checkpointer.close()
        signame = signal.Signals(self.preemption.received).name if self.preemption.received else "a peer's"
        logger.info(f"stop signal ({signame}) at step {self.step}: checkpoint saved to "
                    f"{self.checkpointer.last_complete()}; exiting")

    def close(self) -> None:
        self.checkpointer.close()
        self.metrics.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    trainer = None
    try:
        cfg = load_config(argv, default_config=DEFAULT_CONFIG)
        trainer = Trainer(cfg)
        trainer.train()
    except TrainingDiverged as e:
        print(f"titanlite: error: {e}", file=sys.stderr, flush=True)
        return 3
    except UserError as e:
        print(f"titanlite: error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        if trainer is not None:
            trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
