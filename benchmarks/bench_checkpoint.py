"""How long a checkpoint save stalls the training loop: synchronous vs async DCP saves, and what node-local
saves (`checkpoint.local_interval`) cost the step, in one launch.

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/bench_checkpoint.py \
        [--steps-before 5] [--steps-after 6] [--local-interval 5] [--local-steps 40] [--out DIR]

For each model (the debug flavor, and a 1024-dim x 8-layer Llama) and each save mode, the trainer itself
(`Trainer(cfg, plan)`: `titanlite.run.build` with that model, SimpleFSDP) trains on fixed random tokens with
the shipped `Trainer.train_step`; its `CheckpointManager.save` runs after every step as in the training
loop and saves once (the step after `--steps-before`). Without torchrun it is a world of one.
Reported per row (rank 0, a markdown table):

- blocking call: time spent inside the `save()` call that saves (sync: the whole save; async: collecting
  the state dict, per-rank files and staging a CPU copy);
- loop slowdown: wall time from that call to the end of `close()` minus what the same number of steps
  takes without a save (median step time before the save) -- the total cost the save adds to training,
  including contention of the background writer with compute and any final wait;
- get_state_dict: the part of the blocking call spent in `get_state_dict` (under SimpleFSDP it gathers
  every parameter once to resolve names).

`async_with_pinned_mem` is measured on CUDA only (on CPU it is the same as `async`).

Node-local saves (a second table): two trainers of the model train `--local-steps` steps each, one
without and one with a node-local save every `--local-interval` steps (into a folder under /dev/shm, the
default's file system), in alternating blocks; each step is timed with its `save()` call. Reported: the
mean step time of both (the first block not counted), the median blocking call of a local save (state
dict, host copy, rank state), one copy's size (every rank's) and the background write's time (rank 0's,
from its record).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from titanlite.checkpoint.node_local import RECORD, STATE, NodeLocal
from titanlite.config import JobConfig
from titanlite.data.batch import Batch
from titanlite.models.llama3 import ModelArgs, llama3_configs
from titanlite.planning.run_plan import RunPlan
from titanlite.run.build import init_device, init_distributed, world_from_env
from titanlite.run.trainer import Trainer

VOCAB, SEQ, LOCAL_BATCH = 2056, 64, 2
MODELS = {
    "debugmodel": ModelArgs(**{**llama3_configs["debugmodel"].__dict__, "vocab_size": VOCAB}),
    "1024x8": ModelArgs(dim=1024, n_layers=8, n_heads=16, n_kv_heads=8, vocab_size=VOCAB, max_seq_len=2048),
}


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def bench_config(dump: Path, device: torch.device) -> JobConfig:
    cfg = JobConfig()
    cfg.job.dump_folder = str(dump)
    cfg.training.mixed_precision_param = "float32" if device.type == "cpu" else "bfloat16"
    cfg.training.seq_len, cfg.training.local_batch_size, cfg.training.steps = SEQ, LOCAL_BATCH, 1000
    cfg.metrics.enable_tensorboard = False
    return cfg


def fixed_batch(rank: int) -> list[Batch]:
    g = torch.Generator().manual_seed(rank)
    return [Batch.of_windows(torch.randint(0, VOCAB, (LOCAL_BATCH, SEQ + 1), generator=g))]


def step_once(trainer, step: int, batch: list[Batch], device: torch.device) -> float:
    """The trainer's own step `step`, finished on the device; the time it finished."""
    trainer.step = step
    trainer.train_step(batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def measure(name: str, mode: str, out: Path, opts, rank: int, world: int, device: torch.device) -> dict:
    cfg = JobConfig()
    cfg.job.dump_folder = str(out / f"{name}-{mode}")
    cfg.checkpoint.enable, cfg.checkpoint.interval, cfg.checkpoint.async_mode = True, 10**9, mode
    cfg.training.mixed_precision_param = "float32" if device.type == "cpu" else "bfloat16"
    cfg.training.seq_len, cfg.training.local_batch_size, cfg.training.steps = SEQ, LOCAL_BATCH, 1000
    cfg.metrics.enable_tensorboard = False
    args = MODELS[name]
    trainer = Trainer(cfg, RunPlan.build(cfg, world, args=args))  # the run as the trainer builds it
    model, optimizer, ckpt = trainer.model, trainer.optimizer, trainer.checkpointer
    batch = fixed_batch(rank)
    save_step = opts.steps_before + 1
    step_times, blocking, after_start = [], 0.0, 0.0
    for step in range(1, save_step + opts.steps_after + 1):
        start = time.perf_counter()
        trained = step_once(trainer, step, batch, device)
        if step == save_step:
            after_start = trained
        ckpt.save(step, force=step == save_step)
        if step == save_step:
            blocking = time.perf_counter() - trained
        elif step < save_step and step > 1:  # step 1 warms up
            step_times.append(trained - start)
    ckpt.close()
    loop = time.perf_counter() - after_start
    baseline = statistics.median(step_times)
    start = time.perf_counter()
    get_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    gsd = time.perf_counter() - start
    trainer.close()  # the process group is main's and stays open
    folder = Path(cfg.job.dump_folder) / "checkpoint" / f"step-{save_step}"
    return {
        "model": name,
        "params": args.num_params(),
        "mode": mode,
        "step": baseline,
        "size": folder_bytes(folder) if rank == 0 else 0,
        "blocking": blocking,
        "slowdown": loop - opts.steps_after * baseline,
        "gsd": gsd,
    }


def measure_local(name: str, out: Path, opts, rank: int, world: int, device: torch.device) -> dict:
    """Mean step time (train_step + save) without and with node-local saves, and what one save costs. The
    two runs alternate in blocks of `2 x --local-interval` steps, so a change in the machine's load falls
    on both alike."""
    k = opts.local_interval
    row: dict = {"model": name, "params": MODELS[name].num_params(), "interval": k}
    trainers, times, blocking = {}, {False: [], True: []}, []
    for local in (False, True):
        cfg = bench_config(out / f"{name}-local-{local}", device)
        cfg.checkpoint.enable, cfg.checkpoint.interval = True, 10**9
        if local:
            cfg.checkpoint.local_interval, cfg.checkpoint.local_folder = k, str(out / f"{name}-shm")
        trainers[local] = Trainer(cfg, RunPlan.build(cfg, world, args=MODELS[name]))
        trainers[local].checkpointer.load()  # as the trainer's loop starts (it records the line of the copies)
    batch = fixed_batch(rank)
    for first in range(1, opts.local_steps + 1, 2 * k):
        for local, trainer in trainers.items():
            for step in range(first, first + 2 * k):
                start = time.perf_counter()
                trained = step_once(trainer, step, batch, device)
                trainer.checkpointer.save(step)
                if first > 1:  # the first block warms up
                    times[local].append(time.perf_counter() - start)
                    if local and step % k == 0:
                        blocking.append(time.perf_counter() - trained)
    for local, trainer in trainers.items():
        trainer.checkpointer.close()
        row["with" if local else "without"] = statistics.mean(times[local])
    if world > 1:
        dist.barrier()  # every rank's copy written
    if rank == 0:
        row["blocking"] = statistics.median(blocking)
        copies = [NodeLocal(out / f"{name}-shm", r) for r in range(world)]
        newest = [c.step_dir(c.steps()[-1]) for c in copies]
        row["size"] = sum((p / STATE).stat().st_size for p in newest)
        row["write"] = json.loads((newest[0] / RECORD).read_text())["seconds"]
    for trainer in trainers.values():
        trainer.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps-before", type=int, default=5)
    parser.add_argument("--steps-after", type=int, default=6)
    parser.add_argument("--out", default="")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--local-interval", type=int, default=5)
    parser.add_argument("--local-steps", type=int, default=40)
    opts = parser.parse_args()
    rank, world = world_from_env()
    device = init_device()  # the trainer's device and process group (one rank too), shared by the rows
    group_cfg = JobConfig()
    group_cfg.comm.init_timeout_seconds = 600
    init_distributed(group_cfg, device)
    modes = ["disabled", "async"] + (["async_with_pinned_mem"] if device.type == "cuda" else [])
    with tempfile.TemporaryDirectory(dir=opts.out or None) as tmp:
        out = Path(tmp)
        if world > 1:  # every rank writes into rank 0's temporary folder
            box = [tmp]
            dist.broadcast_object_list(box, src=0)
            out = Path(box[0])
        rows = [
            measure(name, mode, out, opts, rank, world, device) for name in opts.models.split(",") for mode in modes
        ]
        if world > 1:
            dist.barrier()
        shm = [tempfile.mkdtemp(dir="/dev/shm") if rank == 0 else None]  # one node: every rank writes there
        if world > 1:
            dist.broadcast_object_list(shm, src=0)
        local_rows = [measure_local(name, Path(shm[0]), opts, rank, world, device) for name in opts.models.split(",")]
        if world > 1:
            dist.barrier()
        if rank == 0:
            shutil.rmtree(shm[0])
    if rank == 0:
        print(
            f"\n{world} rank(s), {device.type}, SimpleFSDP, seq {SEQ}, local batch {LOCAL_BATCH}; "
            f"one save after step {opts.steps_before + 1}, {opts.steps_after} steps after it\n"
        )
        print(
            "| model | params | checkpoint | save mode | step time | blocking call | loop slowdown | get_state_dict |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['size'] / 2**20:.0f} MiB | {r['mode']} | "
                f"{r['step']:.2f}s | {r['blocking']:.2f}s | {r['slowdown']:.2f}s | {r['gsd']:.2f}s |"
            )
        print(
            f"\nnode-local saves every {opts.local_interval} steps, {opts.local_steps} steps in blocks of "
            f"{2 * opts.local_interval} alternating with a run without them (the first block not timed), into "
            "/dev/shm\n"
        )
        print("| model | params | step time without | step time with | blocking call | copy (all ranks) | write |")
        print("|---|---|---|---|---|---|---|")
        for r in local_rows:
            print(
                f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['without']:.3f}s | {r['with']:.3f}s | "
                f"{r['blocking']:.3f}s | {r['size'] / 2**20:.0f} MiB | {r['write']:.3f}s |"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
