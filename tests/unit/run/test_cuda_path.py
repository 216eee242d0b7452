"""The CUDA path's device-independent logic, on CPU: host syncs per step, pinned non-blocking input copies
and loader workers, the allocator default, the seed checkpoint built off the accelerator, and how
run_train.sh counts GPUs (a fake `nvidia-smi` and a torch that reports GPUs).

A GPU is simulated where the logic only asks torch about one (`torch.cuda.is_available`,
`device_count`); the work itself stays on the CPU.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from builders import config
from host_syncs import SyncCounter

import titanlite.run.trainer as trainer_module
from harness import ROOT, child_env, one_rank_group, tiny_args
from titanlite.config import JobConfig
from titanlite.data.batch import Batch
from titanlite.errors import ConfigError
from titanlite.launcher.preflight import preflight
from titanlite.models.common.init import InitSpec, init_parameter_, init_parameters_
from titanlite.parallelisms.parallel_dims import ParallelDims
from titanlite.planning.run_plan import RunPlan
from titanlite.run.build import CUDA_ALLOC_CONF, init_device, prepare_flight_recorder
from titanlite.run.loader import build_loader, loader_workers
from titanlite.run.replica_batches import replica_batches
from titanlite.run.trainer import Trainer
from titanlite.tools.dry_run import fake_process_group
from titanlite.tools.visible_gpus import visible_gpus


@pytest.fixture(autouse=True)
def _process_group(request):
    """As a single-process run: a one-rank process group (a test of several ranks makes its own)."""
    if "fake_world" in request.fixturenames:
        yield
        return
    with one_rank_group():
        yield


@pytest.fixture
def fake_world() -> Callable[[int, int], AbstractContextManager[None]]:
    """`fake_process_group(rank, world_size)`: the test is each of several ranks in turn, on torch's fake
    process group (collectives do nothing), and gets no one-rank group."""
    return fake_process_group


RUN = dict(training__seq_len=8, training__local_batch_size=2, training__steps=3, metrics__log_freq=1)
"""The runs of this file: 3 steps of 2 x 8 tokens, every step logged."""


def trainer_of(cfg: JobConfig) -> Trainer:
    return Trainer(cfg, RunPlan.build(cfg, 1, args=tiny_args(vocab_size=2056)))


def test_one_host_sync_per_step_even_when_logging_every_step_and_skipping_a_nonfinite_step(
    tmp_path, monkeypatch, caplog
):
    trainer = trainer_of(config(tmp_path, RUN, training__skip_nonfinite_steps=1))
    monkeypatch.setenv("TITANLITE_FAULT_NAN_AT", "3")
    counter = SyncCounter(monkeypatch, trainer.optimizer)
    with counter:
        trainer.train()  # 3 steps, each logged; step 3 is not finite and is skipped
        calls = list(counter.calls)
        torch.zeros(()).item()  # the negative control: a read the loop does not make is counted
    monkeypatch.undo()
    trainer.close()
    assert len(counter.calls) == len(calls) + 1
    assert len(calls) == 3, "\n".join(calls)
    assert all("resilience.py" in c for c in calls), calls
    assert trainer.skipped_steps == 1 and "non-finite step 3: loss nan" in caplog.text
    rows = [line for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    assert counter.copies == 6  # inputs and labels of each step, none blocking


@pytest.mark.parametrize("degrees", [dict(tp=2), dict(cp=2), dict(pp=2)], ids=["tp", "cp", "pp"])
def test_a_replicas_batches_reach_the_device_without_a_host_sync_under_tp_cp_or_pp(monkeypatch, fake_world, degrees):
    """Under tensor, context or pipeline parallelism one rank of a replica reads its batches and broadcasts
    them (`replica_batches`): the reader's copy of each batch to the device does not block (it is counted as
    the trainer loop's syncs are), and its peer, which receives, copies nothing."""
    dims = ParallelDims(dp_replicate=1, dp_shard=1, world_size=2, **{"tp": 1, **degrees})
    shape = (2, 4)
    counter = SyncCounter(monkeypatch)
    seen = {}
    for rank in range(2):
        loader = (Batch(*(torch.full(shape, 10 * i + f) for f in range(3))) for i in range(3))
        with fake_world(rank, 2), counter:
            batches = replica_batches(loader, dims, torch.device("cpu"), shape, 60)
            seen[rank] = [next(batches) for _ in range(3)], list(counter.calls), counter.copies
    monkeypatch.undo()
    (read, calls, copies), (_, peer_calls, peer_copies) = seen[0], seen[1]
    assert [[int(t[0, 0]) for t in batch] for batch in read] == [[0, 1, 2], [10, 11, 12], [20, 21, 22]]
    assert calls == [] and copies == 3, calls
    assert peer_calls == [] and peer_copies == copies  # the receiver copies nothing


def test_cuda_loader_pins_batches_and_gets_workers(tmp_path):
    cfg = config(tmp_path, RUN)
    plan = RunPlan.build(cfg, 1, args=tiny_args(vocab_size=2056))
    assert build_loader(plan, 0, "cuda").pin_memory and not build_loader(plan, 0, "cpu").pin_memory
    expected = {(1, "cuda"): 1, (2, "cuda"): 2, (3, "cuda"): 1, (4, "cuda"): 2, (2, "cpu"): 0}
    for (accum, device), workers in expected.items():
        cfg = config(tmp_path, RUN, training__global_batch_size=2 * accum)
        assert loader_workers(RunPlan.build(cfg, 1, args=tiny_args()), device) == workers, (accum, device)
    cfg = config(tmp_path, RUN, training__global_batch_size=4, training__dataloader_num_workers=0)
    assert loader_workers(RunPlan.build(cfg, 1, args=tiny_args()), "cuda") == 0  # the user's choice
    # A microbatch that cannot hold whole virtual-shard contributions: no workers rather than an error.
    cfg = config(
        tmp_path, RUN, training__global_batch_size=12, training__local_batch_size=3, training__dataset_virtual_shards=2
    )
    assert loader_workers(RunPlan.build(cfg, 1, args=tiny_args()), "cuda") == 0


def test_expandable_segments_by_default_on_cuda_only_and_never_over_the_users_setting(monkeypatch):
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert init_device().type == "cpu" and "PYTORCH_ALLOC_CONF" not in os.environ
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert init_device() == torch.device("cuda", 0)
    assert os.environ["PYTORCH_ALLOC_CONF"] == CUDA_ALLOC_CONF == "expandable_segments:True"
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
        monkeypatch.setenv(var, "max_split_size_mb:128")
        init_device()
        assert os.environ[var] == "max_split_size_mb:128"
        assert var == "PYTORCH_ALLOC_CONF" or "PYTORCH_ALLOC_CONF" not in os.environ
        monkeypatch.delenv(var)


# --- seed checkpoint --------------------------------------------------------------------------------


def test_seed_checkpoint_is_built_on_the_cpu_on_a_gpu_node_and_equals_the_trainers_init(tmp_path, monkeypatch):
    def touched(*args, **kwargs):
        raise AssertionError("the accelerator was used")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(trainer_module, "init_device", touched)
    with pytest.raises(AssertionError, match="accelerator"):  # the negative control: a training run uses it
        trainer_of(config(tmp_path / "train", RUN, training__seed=5))
    cfg = config(tmp_path / "seed", RUN, training__seed=5)
    cfg.checkpoint.create_seed_checkpoint = True
    seed = trainer_of(cfg)
    assert {p.device.type for p in seed.model.parameters()} == {"cpu"} and seed.dataloader is None
    monkeypatch.undo()  # (DCP asks CUDA for its device where torch says there is one)
    seed.train()
    seed.close()
    reference = trainer_of(config(tmp_path / "train", RUN, training__seed=5))
    expected = {k: v.full_tensor() for k, v in reference.model.state_dict().items()}
    reference.close()
    loaded = {k: torch.empty_like(v) for k, v in expected.items()}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "seed" / "checkpoint" / "step-0"))
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_a_seed_checkpoint_of_several_processes_stops_before_any_rank_starts(tmp_path):
    argv = ["--checkpoint.create_seed_checkpoint", "--job.dump_folder", str(tmp_path)]
    with pytest.raises(ConfigError, match=r"single process \(world size 8; NGPU=1 ./run_train.sh"):
        preflight(argv, world_size=8)


def test_threaded_init_draws_the_same_values_as_one_thread():
    specs = [InitSpec("normal", 1.0), InitSpec("trunc_normal", 0.02, 0.06), InitSpec("ones")]
    shapes = [(3000, 700), (5, 300_000), (64,)]  # several chunks; a row longer than a chunk
    threaded = [(f"p{i}", torch.empty(s), spec) for i, (s, spec) in enumerate(zip(shapes, specs))]
    init_parameters_(threaded, seed=3, threads=4)
    for name, param, spec in threaded:
        one = torch.empty(param.shape)
        init_parameter_(one, spec, 3, name)
        assert torch.equal(one, param), name


# --- counting GPUs ------------------------------------------------------------------------------------


def test_visible_gpus_is_torchs_count(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # a CUDA build (a CPU build is not asked)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert visible_gpus() == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert visible_gpus() == 3


FAKE_NVIDIA_SMI = """#!/bin/sh
# 8 GPUs, the first one split into 2 MIG instances: 10 lines.
for i in 0 1 2 3 4 5 6 7; do echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-$i)"; done
echo "  MIG 3g.40gb     Device  0: (UUID: MIG-a)"
echo "  MIG 3g.40gb     Device  1: (UUID: MIG-b)"
"""

# torch on a GPU node reports the devices CUDA_VISIBLE_DEVICES leaves (here: simply counted).
FAKE_TORCH_CUDA = """import os
if "FAKE_TORCH_GPUS" in os.environ:
    import torch
    torch.version.cuda = "12.8"
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: len([d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d])
"""


def run_train(tmp_path: Path, *args: str, fake_torch: bool, **env: str) -> subprocess.CompletedProcess:
    bin_dir, site = tmp_path / "bin", tmp_path / "site"
    bin_dir.mkdir(exist_ok=True)
    site.mkdir(exist_ok=True)
    (bin_dir / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    (site / "sitecustomize.py").write_text(FAKE_TORCH_CUDA)
    environ = child_env(**env)
    environ.pop("NGPU", None)
    environ["PATH"] = f"{bin_dir}{os.pathsep}{environ['PATH']}"
    environ["PYTHONPATH"] = f"{site}{os.pathsep}{environ['PYTHONPATH']}"
    if fake_torch:
        environ["FAKE_TORCH_GPUS"] = "1"
    return subprocess.run(
        [str(ROOT / "run_train.sh"), *args], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_run_train_starts_one_rank_per_gpu_torch_sees_not_per_nvidia_smi_line(tmp_path):
    proc = run_train(tmp_path, fake_torch=True, CUDA_VISIBLE_DEVICES="0,2,5", DRY_LAUNCH="1", MAX_RESTARTS="0")
    assert proc.returncode == 0 and "--nproc_per_node=3 " in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.slow
def test_dry_run_on_a_gpu_node_plans_for_the_configs_world_size(tmp_path):
    config_file = tmp_path / "debug_64.toml"
    config_file.write_text((ROOT / "train_configs/debug_model.toml").read_text() + "\n[comm]\nfake_world_size = 4\n")
    proc = run_train(tmp_path, "--config", str(config_file), "--dry-run", fake_torch=True, CUDA_VISIBLE_DEVICES="0,1")
    assert "world 4 (fake process group, rank 0)" in proc.stdout, proc.stdout + proc.stderr


def test_the_flight_recorders_folder_exists_before_nccl_could_write_to_it(tmp_path):
    """NCCL dumps its traces on a timeout to `<prefix><rank>` and does not create the folder: every rank
    creates it before its process group exists, also for a user's own prefix (which wins)."""
    env: dict[str, str] = {}
    prepare_flight_recorder(str(tmp_path / "dump"), env)
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "dump" / "comm_traces" / "rank_")
    assert (tmp_path / "dump" / "comm_traces").is_dir()
    env = {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "mine" / "trace_")}
    prepare_flight_recorder(str(tmp_path / "other"), env)
    assert (tmp_path / "mine").is_dir() and not (tmp_path / "other").exists()


@pytest.mark.parametrize("resumed_at", [0, 3], ids=["fresh", "resumed"])
def test_the_train_timeout_is_set_after_the_first_step_this_process_runs(tmp_path, monkeypatch, resumed_at):
    """Step 1 of a fresh run, and the first step after a resume (or an elastic restart, which resumes)."""
    trainer = trainer_of(config(tmp_path, RUN, training__steps=5))
    monkeypatch.setattr(trainer.checkpointer, "load", lambda: resumed_at)
    applied = []
    monkeypatch.setattr(trainer_module, "apply_train_timeout", lambda cfg, dims: applied.append(trainer.step))
    trainer.train()
    trainer.close()
    assert applied == [resumed_at + 1]
