"""Checkpointing in one process: exact restore, atomic folders, damaged and corrupted folders, model-only
saves, seed checkpoints, initial loads, failed saves, the dump-folder lock, resuming with changed settings,
and the data loader's resharding rule at the loader level.

The multi-process resume, kill and reshard runs are in test_checkpoint_resume.py; the same faults through
the command line in test_checkpoint_faults.py; HF interop in test_checkpoint_hf.py.
"""

from __future__ import annotations

import copy
import errno
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from builders import config, loader
from checkpointed_run import ARGS, LBS, TOK, Run, full_state
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from harness import ROOT, child_env
from titanlite.checkpoint import folders, lineage, lock, purge, rank_state
from titanlite.checkpoint.hf import export_hf
from titanlite.checkpoint.manager import CheckpointManager
from titanlite.errors import CheckpointError, ConfigError, DumpFolderInUse, run_cli
from titanlite.launcher import preflight
from titanlite.models.llama3 import SPEC, ModelArgs
from titanlite.parallelisms.parallel_dims import WorldLayout
from titanlite.planning.run_plan import RunPlan
from titanlite.run.optimizer import lr_factor


@pytest.fixture(autouse=True)
def _process_group(process_group):
    """Each test runs as a single-process run does: in a one-rank process group."""


def root(dump: Path) -> Path:
    return dump / "checkpoint"


def saved_run(dump: Path, steps: int = 2, **ckpt) -> Run:
    run = Run(dump, **ckpt)
    run.train(1, steps)
    run.ckpt.close()
    return run


def warnings_of(caplog) -> list[str]:
    """The trainer's warnings (DCP also logs a failed save, on a logger with only a NullHandler)."""
    return [r.getMessage() for r in caplog.records if r.name == "titanlite" and r.levelno >= logging.WARNING]


# --- exact restore and folder layout ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "async_mode", ["disabled", "async", pytest.param("async_with_pinned_mem", marks=pytest.mark.slow)]
)
def test_resume_restores_everything_exactly(tmp_path, async_mode, caplog):
    caplog.set_level(logging.INFO, logger="titanlite")
    ref = Run(tmp_path / "ref", async_mode=async_mode)
    ref_losses = ref.train(1, 6)
    ref.ckpt.close()
    run = Run(tmp_path / "run", async_mode=async_mode, interval=3)
    run.train(1, 4)  # step-3 is the last save; step 4 is lost
    run.ckpt.close()
    resumed = Run(tmp_path / "run", seed=1, async_mode=async_mode, interval=3)  # other init: all must come from disk
    assert resumed.ckpt.load() == 3
    assert resumed.train(4, 6) == ref_losses[3:]
    assert resumed.sched.get_last_lr() == ref.sched.get_last_lr()
    for k, v in ref.params().items():
        assert torch.equal(v, full_state(resumed.model)[k]), k
    if async_mode == "async_with_pinned_mem":
        assert "no pinned memory on CPU, using async" in caplog.text


def test_folder_layout_and_marker(tmp_path):
    run = saved_run(tmp_path, steps=2)
    assert sorted(p.name for p in root(tmp_path).iterdir()) == ["step-1", "step-2"]
    path = root(tmp_path) / "step-2"
    marker = json.loads((path / folders.MARKER).read_text())
    assert marker["step"] == 2 and marker["model_only"] is False and marker["world_size"] == 1
    on_disk = {str(p.relative_to(path)): p.stat().st_size for p in path.rglob("*") if p.is_file()}
    del on_disk[folders.MARKER]
    assert marker["files"] == on_disk
    assert set(on_disk) == {".metadata", "__0_0.distcp", "rank_state/rank-00000.pt"}
    assert marker["checksums"] == {rel: folders.checksum(path / rel) for rel in on_disk}
    assert marker["config"] == run.cfg.to_dict() and marker["global_batch"] == LBS
    assert marker["dataset"]["files"] == 12 and len(marker["tokenizer"]["digest"]) == 16
    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    assert "tok_embeddings.weight" in keys and "train_state.step" in keys
    assert any(k.startswith("optimizer.state.layers.0.attention.wq.weight") for k in keys)
    assert run.ckpt._pending is None


def test_interval_and_keep_latest_k(tmp_path):
    run = Run(tmp_path, interval=2, keep_latest_k=2)
    assert run.ckpt.last_complete() is None
    run.train(1, 7)
    run.ckpt.close()
    assert folders.scan(root(tmp_path)) == ([4, 6], [])
    assert run.ckpt.last_complete() == str(root(tmp_path) / "step-6")


def test_last_complete_waits_for_a_save_in_flight(tmp_path):
    run = Run(tmp_path, async_mode="async", interval=2)
    run.train(1, 2)
    assert run.ckpt.last_complete() == str(root(tmp_path) / "step-2")


def test_disabled_saves_nothing_unless_forced(tmp_path):
    run = Run(tmp_path, enable=False)
    run.train(1, 2)
    assert not root(tmp_path).exists()
    run.ckpt.save(2, force=True)
    run.ckpt.close()
    assert folders.scan(root(tmp_path)) == ([2], [])


def aside(dump: Path, step: int) -> Path:
    """The one folder a resume from `step` moved the newer checkpoints into (`lineage.py`)."""
    (path,) = root(dump).glob(f"{lineage.ABANDONED}*-from-step-{step}")
    return path


def test_a_resume_from_an_older_step_moves_the_newer_ones_aside(tmp_path, caplog):
    saved_run(tmp_path, steps=3)
    old = {s: folders.read_marker(root(tmp_path) / f"step-{s}") for s in (2, 3)}
    again = Run(tmp_path, load_step=1, seed=3, keep_latest_k=1)
    with caplog.at_level(logging.INFO, logger="titanlite"):
        assert again.ckpt.load() == 1
    moved = aside(tmp_path, 1)
    assert f"the newer step-2, step-3 moved to {moved} (kept, never resumed or pruned)" in caplog.text
    assert {s: folders.read_marker(moved / f"step-{s}") for s in (2, 3)} == old
    again.train(2, 2)
    again.ckpt.close()
    assert folders.scan(root(tmp_path)) == ([2], []) and folders.problem(root(tmp_path) / "step-2") is None
    assert folders.scan(moved) == ([2, 3], [])  # neither overwritten nor pruned


def test_pruning_never_takes_the_checkpoint_just_saved(tmp_path):
    for step in (2, 4, 6):
        (root(tmp_path) / f"step-{step}").mkdir(parents=True)
    assert folders.prune(root(tmp_path), 1, folders.delete_now, saved=4) == ([root(tmp_path) / "step-2"], [])
    assert folders.scan(root(tmp_path)) == ([4, 6], [])
    assert folders.prune(root(tmp_path), 1, folders.delete_now) == ([root(tmp_path) / "step-4"], [])


def test_a_restart_with_load_step_resumes_the_line_its_launch_saved(tmp_path, monkeypatch):
    """torch elastic restarts every rank with the same `load_step`: the steps after it that this launch
    wrote (its run id in their markers) are the new line, resumed; another launch's are not."""
    for step, launch in ((2, "old"), (4, "old"), (6, "this")):
        (root(tmp_path) / f"step-{step}").mkdir(parents=True)
        (root(tmp_path) / f"step-{step}" / folders.MARKER).write_text(json.dumps({"launch": launch}))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "this")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert lineage.load_step(root(tmp_path), 2) == 2  # the first attempt: as asked
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert lineage.load_step(root(tmp_path), 2) == -1 and lineage.load_step(root(tmp_path), 6) == 6
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "other")
    assert lineage.load_step(root(tmp_path), 2) == 2


# --- deleting old checkpoints -----------------------------------------------------------------------------


def test_pruning_deletes_in_the_background_one_at_a_time_and_close_waits_for_it(tmp_path, monkeypatch):
    """A deletion that does not finish (held by an event) neither delays the saves and steps after it nor
    lets a second pruned checkpoint queue up behind it: that one stays a complete checkpoint until
    `close`, which retires it and waits for both deletions."""
    release = threading.Event()
    started: list[str] = []

    def slow(path: Path) -> None:
        started.append(path.name)
        assert release.wait(60)

    monkeypatch.setattr(purge.faults, "slow_purge", slow)
    run = Run(tmp_path, keep_latest_k=1)
    run.train(1, 4)
    r = root(tmp_path)
    assert started == ["step-1.deleting"] and (r / "step-1.deleting").is_dir()
    assert folders.scan(r) == ([2, 3, 4], [])  # due, held back by PRUNE_BACKLOG = 1: still complete
    assert run.ckpt._purger.room() == 0
    release.set()
    run.ckpt.close()
    assert sorted(p.name for p in r.iterdir()) == ["step-4"]
    assert started == ["step-1.deleting", "step-2.deleting", "step-3.deleting"]


def test_a_stop_signal_while_the_run_waits_for_a_deletion_ends_the_wait(tmp_path, monkeypatch, caplog):
    """A run that finished waits for its deletions; a stop signal then (the launcher kills ranks still
    running after comm.stop_grace_seconds) ends the wait: the folder stays retired for the next run,
    said in one line. (A stop signal before the wait: tests/runs/test_checkpoint_faults.py.)"""
    caplog.set_level(logging.INFO, logger="titanlite")
    release, waiting = threading.Event(), threading.Event()
    monkeypatch.setattr(purge.faults, "slow_purge", lambda path: (waiting.set(), release.wait(60)))
    (root(tmp_path) / "step-1").mkdir(parents=True)
    purger = purge.Purger()
    purger.submit(folders.retire(root(tmp_path) / "step-1"))
    assert waiting.wait(60)
    asked = []
    purger.finish(root(tmp_path), 1, None, stopping=lambda: asked.append(1) or len(asked) > 2)
    assert len(asked) == 3 and (root(tmp_path) / "step-1.deleting").is_dir()
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "checkpoint: waiting for the deletion of step-1.deleting",
        "checkpoint: stop signal: step-1.deleting left retired, not deleted; the next run deletes them",
    ]
    release.set()
    assert purger.join() == [] and not (root(tmp_path) / "step-1.deleting").exists()


def test_retired_folders_are_never_resumed_and_the_next_run_deletes_them(tmp_path):
    """A crash during a deletion leaves `step-N.deleting`, complete or half deleted: no lister or resume
    sees it, a retired name is never reused, and the next run deletes it."""
    saved_run(tmp_path, steps=2)
    r = root(tmp_path)
    for _ in range(2):
        shutil.copytree(r / "step-2", r / "step-3")
        folders.retire(r / "step-3")
    assert sorted(p.name for p in folders.retired(r)) == ["step-3.deleting", "step-3.deleting-1"]
    assert folders.scan(r) == ([1, 2], []) and folders.newest(r) == r / "step-2"
    again = Run(tmp_path)
    assert again.ckpt.load() == 2
    again.ckpt.close()
    assert folders.retired(r) == [] and folders.scan(r) == ([1, 2], [])


def test_the_async_writers_group_has_the_configured_timeout(tmp_path):
    """Not gloo's default of 30 minutes: a dead peer surfaces within comm.init_timeout_seconds."""
    run = Run(tmp_path, async_mode="async", over={"comm.init_timeout_seconds": 77})
    backend = run.ckpt._writer.pg._get_backend(torch.device("cpu"))
    assert backend.options._timeout == timedelta(seconds=77)
    run.ckpt.close()


# --- damaged and incomplete folders ----------------------------------------------------------------------


@pytest.mark.parametrize("lost", ["a data file", "a rank's state"])
def test_rank_0_never_completes_a_folder_without_every_ranks_files(tmp_path, lost):
    """Ranks writing into folders of their own (or a file lost before the marker): rank 0 refuses to
    publish `step-N`; the folder stays `step-N.partial`, which resume ignores."""
    import torch.distributed.checkpoint as dcp

    partial = folders.partial_dir(tmp_path, 4)
    dcp.save({"w": torch.arange(8.0)}, storage_writer=FileSystemWriter(str(partial)), no_dist=True)
    for r in range(2):
        (partial / folders.rank_state_file(r)).parent.mkdir(exist_ok=True)
        (partial / folders.rank_state_file(r)).write_bytes(b"state")
    info = {"world_size": 2, "model_only": False}
    assert folders.missing_files(partial, 2, False) == []
    gone = folders.referenced_files(partial)[0] if lost == "a data file" else folders.rank_state_file(1)
    (partial / gone).unlink()
    with pytest.raises(FileNotFoundError, match=f"rank 0 does not see 1 of the ranks' files in it \\({gone}\\)"):
        folders.complete(tmp_path, 4, info, folders.delete_now)
    assert not folders.step_dir(tmp_path, 4).exists() and partial.is_dir()
    assert not (partial / folders.MARKER).exists()


def _leftover_partial(r: Path) -> str:
    shutil.copytree(r / "step-2", r / "step-3.partial")
    (r / "step-3.partial" / folders.MARKER).unlink()
    return "step-3.partial"


def _no_marker(r: Path) -> str:
    shutil.copytree(r / "step-2", r / "step-3")
    (r / "step-3" / folders.MARKER).unlink()
    return "no completion marker"


def _truncated(r: Path) -> str:
    data = r / "step-2" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:1000])
    return "truncated"


def _no_metadata(r: Path) -> str:
    (r / "step-2" / ".metadata").unlink()
    return "missing file .metadata"


def _bit_flip(r: Path) -> str:
    data = r / "step-2" / "__0_0.distcp"
    flip_a_bit(data)
    return "file __0_0.distcp has CRC-32"


def flip_a_bit(path: Path) -> None:
    """Flip one bit in the middle of `path`: the size stays, only the checksum tells."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _garbled_metadata(r: Path) -> str:
    meta = r / "step-2" / ".metadata"
    meta.write_bytes(b"\0" * meta.stat().st_size)
    return "unreadable DCP metadata"


@pytest.mark.parametrize(
    "damage, expected_step",
    [
        (_leftover_partial, 2),
        (_no_marker, 2),
        (_truncated, 1),
        (_no_metadata, 1),
        (_garbled_metadata, 1),
        (_bit_flip, 1),
    ],
)
def test_damaged_newest_falls_back_to_previous(tmp_path, caplog, damage, expected_step):
    saved = saved_run(tmp_path, steps=1)
    step1 = saved.params()
    saved.train(2, 2)
    saved.ckpt.close()
    problem = damage(root(tmp_path))
    run = Run(tmp_path, seed=5)
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        assert run.ckpt.load() == expected_step
    messages = warnings_of(caplog)
    assert len(messages) == 1 and "\n" not in messages[0], messages
    assert problem in messages[0] and str(root(tmp_path)) in messages[0]
    if expected_step == 1:
        assert all(torch.equal(v, full_state(run.model)[k]) for k, v in step1.items())
    assert not any(p.name.endswith(".partial") for p in root(tmp_path).iterdir())


def test_nothing_usable_is_a_one_line_error(tmp_path):
    saved_run(tmp_path, steps=1)
    (root(tmp_path) / "step-1" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"no usable checkpoint in .*step-1: missing file \.metadata") as e:
        Run(tmp_path).ckpt.load()
    assert "\n" not in str(e.value)


def test_only_an_interrupted_save_starts_fresh(tmp_path, caplog):
    saved_run(tmp_path, steps=1)
    (root(tmp_path) / "step-1").rename(root(tmp_path) / "step-1.partial")
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        assert Run(tmp_path).ckpt.load() == 0
    assert "interrupted save" in caplog.text


def test_load_step(tmp_path):
    saved_run(tmp_path, steps=3)
    with pytest.raises(
        CheckpointError, match=r"load_step 7: .*step-7 does not exist \(complete checkpoints: step-1, step-2, step-3\)"
    ):
        Run(tmp_path, load_step=7).ckpt.load()
    flip_a_bit(root(tmp_path) / "step-3" / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=r"step-3 is unusable: file __0_0.distcp has CRC-32 \w+, the marker"):
        Run(tmp_path, load_step=3).ckpt.load()
    (root(tmp_path) / "step-2" / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"step-2 is unusable: file __0_0.distcp has 1 bytes"):
        Run(tmp_path, load_step=2).ckpt.load()
    assert folders.scan(root(tmp_path)) == ([1, 2, 3], [])  # a refused resume moves nothing
    assert Run(tmp_path, load_step=1).ckpt.load() == 1
    assert folders.scan(root(tmp_path)) == ([1], []) and folders.scan(aside(tmp_path, 1)) == ([2, 3], [])


def test_another_model_shape_is_refused_before_loading(tmp_path):
    saved_run(tmp_path, steps=1)
    other = ModelArgs(**{**ARGS.__dict__, "dim": 32})
    run = Run(tmp_path, args=other, seed=9)
    before = run.params()
    with pytest.raises(
        CheckpointError, match=r"step-1: 'tok_embeddings.weight' has shape \(2056, 64\), this model \(2056, 32\)"
    ):
        run.ckpt.load()
    assert all(torch.equal(v, full_state(run.model)[k]) for k, v in before.items())
    deeper = ModelArgs(**{**ARGS.__dict__, "n_layers": 3})
    with pytest.raises(CheckpointError, match=r"step-1 has no entry 'layers.2.attention.wq.weight'"):
        Run(tmp_path, args=deeper).ckpt.load()


def test_a_shallower_model_is_refused_before_loading(tmp_path):
    """A model with fewer blocks than the checkpoint's would load a prefix of its parameters and leave the
    rest unread: every parameter the checkpoint holds must be the model's, from a full resume and from a
    seed checkpoint alike, with the model untouched."""
    saved_run(tmp_path, steps=1)
    shallower = ModelArgs(**{**ARGS.__dict__, "n_layers": 1})
    run = Run(tmp_path, args=shallower, seed=9)
    before = run.params()
    with pytest.raises(CheckpointError, match=r"step-1 holds 'layers\.1\.\S+', which this model lacks"):
        run.ckpt.load()
    assert all(torch.equal(v, full_state(run.model)[k]) for k, v in before.items())
    seed = Run(tmp_path / "seed", create_seed_checkpoint=True, enable=False)
    seed.ckpt.save(0, force=True, model_only=True)
    seed.ckpt.close()
    shutil.copytree(root(tmp_path / "seed"), root(tmp_path / "run"))
    with pytest.raises(CheckpointError, match=r"step-0 holds 'layers\.1\.\S+', which this model lacks"):
        Run(tmp_path / "run", args=shallower).ckpt.load()
    assert Run(tmp_path / "run").ckpt.load() == 0  # the seed's own model starts from it


def test_a_tool_reads_the_model_as_it_was_trained(tmp_path):
    """HF export and generation (`load_tool_weights`) refuse a model setting other than the one the checkpoint
    recorded, even one no tensor shows (RoPE's theta), in one line before anything loads; the run's own
    settings load."""
    from titanlite.checkpoint.weights import load_tool_weights

    saved_run(tmp_path, steps=1)
    run = Run(tmp_path, seed=9)
    other = copy.deepcopy(run.cfg)
    other.model.rope_theta = 10000.0
    before = run.params()
    with pytest.raises(CheckpointError, match=r"model\.rope_theta was \S+, this config has 10000\.0: a tool reads"):
        load_tool_weights(run.model, other, step=1)
    assert all(torch.equal(v, full_state(run.model)[k]) for k, v in before.items())
    assert load_tool_weights(run.model, run.cfg, step=1) == root(tmp_path) / "step-1"
    assert not all(torch.equal(v, full_state(run.model)[k]) for k, v in before.items())


def test_an_initial_load_refuses_untied_embeddings_into_a_tied_model():
    """`initial_load_path` of another run's checkpoint: its tensors may change shape checks aside, but another
    family, or untied embeddings into a model that ties them (one of the two matrices would be lost), is
    refused; a tied checkpoint into an untied model (both keys hold the one matrix) and the same tying load."""
    from titanlite.checkpoint.weights import another_model

    def plan(flavor: str) -> RunPlan:
        return RunPlan.build(config(None, model__name="qwen3", model__flavor=flavor), 1)

    def marker(name: str, flavor: str) -> dict:
        return {"config": {"model": {"name": name, "flavor": flavor}}}

    tied, untied = plan("debugmodel_tied"), plan("debugmodel")
    assert another_model(marker("qwen3", "debugmodel"), tied) == (
        "its model.flavor 'debugmodel' has untied embeddings, this run's ties them"
    )
    assert another_model(marker("llama3", "debugmodel"), tied) == "it holds a 'llama3' model, this run trains 'qwen3'"
    assert another_model(marker("qwen3", "debugmodel_tied"), untied) is None
    assert another_model(marker("qwen3", "debugmodel_tied"), tied) is None
    assert another_model(marker("qwen3", "debugmodel"), untied) is None
    assert another_model({}, tied) is None


# --- model-only saves, seed checkpoints, initial loads ----------------------------------------------------


def test_last_save_model_only_in_export_dtype(tmp_path, caplog):
    run = Run(tmp_path, interval=10, last_save_model_only=True, export_dtype="bfloat16")
    run.train(1, 20)
    run.ckpt.close()
    path = root(tmp_path) / "step-20"
    marker = folders.read_marker(path)
    assert marker["model_only"] and marker["dtype"] == "bfloat16"
    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    assert set(meta) == set(run.model.state_dict())
    assert all(m.properties.dtype == torch.bfloat16 for m in meta.values())
    assert not (path / "rank_state").exists()
    shutil.copytree(root(tmp_path), root(tmp_path / "copy"))
    # Resuming skips the weights-only folder and takes the full one before it; the weights are moved
    # aside, out of the way of the resumed run's save of step 20.
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        assert Run(tmp_path).ckpt.load() == 10
    assert "step-20 is unusable: holds only the model weights" in caplog.text
    assert folders.scan(aside(tmp_path, 10)) == ([20], [])
    # An explicit load_step takes its weights (cast back to fp32) and starts over, a new line from step 0.
    fresh = Run(tmp_path / "copy", load_step=20, seed=4)
    assert fresh.ckpt.load() == 0
    for k, v in full_state(run.model).items():
        assert torch.equal(full_state(fresh.model)[k], v.bfloat16().float()), k
    assert folders.scan(aside(tmp_path / "copy", 0)) == ([10, 20], [])


def test_seed_checkpoint_and_initial_load(tmp_path):
    seed = Run(tmp_path / "seed", create_seed_checkpoint=True, enable=False)
    seed.ckpt.save(0, force=True, model_only=True)
    seed.ckpt.close()
    path = root(tmp_path / "seed") / "step-0"
    assert folders.read_marker(path)["model_only"]
    # In the checkpoint folder, a seed checkpoint starts the run from its weights at step 0.
    shutil.copytree(root(tmp_path / "seed"), root(tmp_path / "run"))
    run = Run(tmp_path / "run", seed=7)
    assert run.ckpt.load() == 0
    assert all(torch.equal(v, full_state(run.model)[k]) for k, v in seed.params().items())
    # initial_load_path works with checkpointing disabled, and from a full checkpoint too.
    for source in (path, root(tmp_path / "run") / "step-2"):
        if source.name == "step-2":
            run.train(1, 2)
            run.ckpt.close()
        other = Run(tmp_path / "other", seed=8, enable=False, initial_load_path=str(source))
        assert other.ckpt.load() == 0
        assert all(
            torch.equal(v, full_state(other.model)[k])
            for k, v in (seed.params() if source == path else run.params()).items()
        )


def test_initial_load_in_hf(tmp_path):
    src = Run(tmp_path / "src", seed=3)
    export_hf(src.model, tmp_path / "hf", adapter=SPEC.hf_adapter, bos_id=TOK.bos_id, eos_id=TOK.eos_id)
    run = Run(tmp_path / "run", enable=False, initial_load_path=str(tmp_path / "hf"), initial_load_in_hf=True)
    assert run.ckpt.load() == 0
    assert all(torch.equal(v, full_state(run.model)[k]) for k, v in src.params().items())


def test_seed_checkpoint_needs_one_process(tmp_path):
    run = Run(tmp_path)
    run.cfg.checkpoint.create_seed_checkpoint = True
    with pytest.raises(ConfigError, match="create_seed_checkpoint must run in a single process"):
        CheckpointManager(
            RunPlan.build(run.cfg, 2, args=run.trainer.model_args),
            model=run.model,
            optimizer=run.trainer.optimizer,
            lr_scheduler=run.sched,
            dataloader=run.loader,
            rank=0,
            device=torch.device("cpu"),
        )


def test_a_corrupted_initial_load_path_is_refused(tmp_path):
    saved_run(tmp_path / "src", steps=1)
    flip_a_bit(root(tmp_path / "src") / "step-1" / "__0_0.distcp")
    run = Run(tmp_path / "run", enable=False, initial_load_path=str(root(tmp_path / "src") / "step-1"))
    with pytest.raises(CheckpointError, match=r"step-1 is unusable: file __0_0.distcp has CRC-32 \w+, the marker says"):
        run.ckpt.load()


def test_bad_initial_load_path(tmp_path):
    with pytest.raises(CheckpointError, match="initial_load_path .* is not a folder"):
        Run(tmp_path, initial_load_path=str(tmp_path / "nope")).ckpt.load()
    with pytest.raises(CheckpointError, match="neither model.safetensors.index.json nor model.safetensors"):
        Run(tmp_path, initial_load_path=str(tmp_path), initial_load_in_hf=True).ckpt.load()


# --- save errors ------------------------------------------------------------------------------------------


def test_save_error_warns_or_stops(tmp_path, caplog):
    (tmp_path / "checkpoint").write_text("a file where the checkpoint folder should be")
    run = Run(tmp_path)
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        run.train(1, 1)
    assert "checkpoint step 1 could not be saved" in caplog.text and "training continues" in caplog.text
    stop = Run(tmp_path, stop_on_save_error=True)
    with pytest.raises(CheckpointError, match="checkpoint step 1 could not be saved"):
        stop.train(1, 1)


@pytest.fixture
def failing_write(monkeypatch):
    """DCP's file writer fails with a full disk while writing the data of step 2 (after the rank-state file)."""
    write_data = FileSystemWriter.write_data

    def write_or_fail(self, plan, planner):
        if Path(self.path).name == "step-2.partial":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write_data(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", write_or_fail)


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_a_failed_dcp_write_warns_and_keeps_training(tmp_path, caplog, failing_write, async_mode):
    """The failure reaches the trainer as DCP's CheckpointException (a BaseException)."""
    run = Run(tmp_path, async_mode=async_mode)
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        run.train(1, 3)
        run.ckpt.close()
    (message,) = warnings_of(caplog)
    assert message.startswith("checkpoint step 2 could not be saved to ") and "\n" not in message
    assert f"saved to {root(tmp_path)}/step-2.partial: the disk under {root(tmp_path)} is full (" in message
    assert message.endswith(
        " MiB free; OSError on rank 0: [Errno 28] No space left on device); training continues "
        "(checkpoint.stop_on_save_error = false)"
    )
    assert folders.scan(root(tmp_path)) == ([1, 3], [])
    assert run.ckpt.last_complete() == str(root(tmp_path) / "step-3")


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_a_failed_dcp_write_stops_with_stop_on_save_error(tmp_path, failing_write, async_mode):
    run = Run(tmp_path, async_mode=async_mode, stop_on_save_error=True)
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint step 2 could not be saved .*: the disk under .* is full \([\d,]+ MiB free; "
        r"OSError on rank 0: \[Errno 28\] No space left on device\); "
        r"the last good checkpoint is .*step-1$",
    ):
        run.train(1, 3)
        run.ckpt.close()
    assert folders.scan(root(tmp_path)) == ([1], [])


# --- the dump-folder lock ------------------------------------------------------------------------------------


def hold_in_another_process(
    dump: Path, fork: bool = False, key: str = "job.dump_folder"
) -> tuple[subprocess.Popen, int]:
    """A process that holds `dump`'s lock (as the folder `key` names) until killed (and, with `fork`, a
    forked child of it, as a data loader worker is); returns the process and the child's pid (0 without
    `fork`)."""
    code = (
        "import os, sys, time\n"
        "from titanlite.checkpoint.lock import DumpFolderLock\n"
        "DumpFolderLock(sys.argv[1], sys.argv[3])\n"
        "child = os.fork() if sys.argv[2] == '1' else 0\n"
        "if sys.argv[2] == '1' and child == 0: time.sleep(600); os._exit(0)\n"
        "print('held', child, flush=True); time.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(dump), str(int(fork)), key],
        env=child_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    word, child = proc.stdout.readline().split()
    assert word == "held"
    return proc, int(child)


def locked_for_other_processes(dump: Path) -> bool:
    code = "import sys; from titanlite.checkpoint.lock import check_free; check_free(sys.argv[1])"
    return subprocess.run([sys.executable, "-c", code, str(dump)], env=child_env(), capture_output=True).returncode != 0


def test_lock_names_the_holder_and_is_released_when_it_dies(tmp_path):
    holder, _ = hold_in_another_process(tmp_path)
    try:
        who = rf"\(host {socket.gethostname()}, pid {holder.pid}, since [-\d: ]+\)"
        with pytest.raises(DumpFolderInUse, match=rf"^job.dump_folder {tmp_path} is in use by another run {who}"):
            lock.DumpFolderLock(str(tmp_path))
        with pytest.raises(DumpFolderInUse):
            lock.check_free(str(tmp_path))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # The kernel dropped the dead holder's lock; its .lock file is simply locked again.
    assert f"pid {holder.pid}," in (tmp_path / lock.LOCK_NAME).read_text()
    lock.check_free(str(tmp_path))
    held = lock.DumpFolderLock(str(tmp_path))
    assert f"pid {os.getpid()}," in (tmp_path / lock.LOCK_NAME).read_text()
    held.release()


def test_a_checkpoint_folder_shared_by_two_runs_is_locked_too(tmp_path, monkeypatch, capsys):
    """Two runs whose checkpoint.folder is one folder (an absolute or `..` path outside their dump folders)
    would resume from, move aside and delete each other's checkpoints: a run with checkpointing locks the
    folder itself (no file is written into it), and the preflight refuses a second run in one line; another
    checkpoint folder, or checkpointing off, is not refused (the control)."""
    dump, shared = tmp_path / "b", (tmp_path / "shared").resolve()
    assert lock.run_folders(str(dump), None) == {"job.dump_folder": str(dump)}
    inside = {"job.dump_folder": str(dump), "checkpoint.folder": str((dump / "checkpoint").resolve())}
    assert lock.run_folders(str(dump), "checkpoint") == inside
    for folder in ("../shared", str(shared)):
        assert lock.run_folders(str(dump), folder) == {"job.dump_folder": str(dump), "checkpoint.folder": str(shared)}
    holder, _ = hold_in_another_process(shared, key="checkpoint.folder")
    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = ["--config", "train_configs/debug_model.toml", "--job.dump_folder", str(dump)]
    try:
        assert list(shared.iterdir()) == []
        assert run_cli(preflight.main, [*argv, "--checkpoint.enable", "--checkpoint.folder", "../shared"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            f"titanlite: error: checkpoint.folder {shared} is in use by another run: wait for it to end or choose "
            "another checkpoint.folder"
        ], err
        with pytest.raises(DumpFolderInUse, match=rf"^checkpoint.folder {shared} is in use"):
            lock.DumpFolderLock(str(shared), "checkpoint.folder")
        assert run_cli(preflight.main, [*argv, "--checkpoint.folder", "../shared"]) == 0  # checkpointing off
        assert run_cli(preflight.main, [*argv, "--checkpoint.enable"]) == 0
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    held = lock.DumpFolderLock(str(shared), "checkpoint.folder")  # released with its holder's death
    held.release()
    assert list(shared.iterdir()) == []


def test_lock_is_not_kept_by_a_forked_child_of_a_dead_holder(tmp_path):
    holder, child = hold_in_another_process(tmp_path, fork=True)
    try:
        assert locked_for_other_processes(tmp_path)
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        assert not locked_for_other_processes(tmp_path)  # while the child lives on
        os.kill(child, 0)
    finally:
        os.kill(child, signal.SIGKILL)


def test_lock_is_shared_by_the_trainers_of_one_process(tmp_path):
    first = Run(tmp_path)
    second = Run(tmp_path)  # a benchmark or test building several trainers: no conflict
    first.trainer.close()
    assert locked_for_other_processes(tmp_path)
    second.trainer.close()
    assert not locked_for_other_processes(tmp_path)


# --- resuming with changed settings -------------------------------------------------------------------------


def test_new_optimizer_settings_apply_after_resume(tmp_path, caplog):
    """A new lr (and weight decay, betas) replaces the checkpoint's in the optimizer and the LR schedule."""
    saved_run(tmp_path, steps=2)
    over = {"optimizer.lr": 4e-4, "optimizer.weight_decay": 0.05, "optimizer.beta2": 0.99, "training.steps": 30}
    run = Run(tmp_path, over=over)
    with caplog.at_level(logging.INFO, logger="titanlite"):
        assert run.ckpt.load() == 2
    (line,) = [r.getMessage() for r in caplog.records if "settings changed" in r.getMessage()]
    assert "optimizer.lr 0.0008 -> 0.0004, optimizer.beta2 0.95 -> 0.99, optimizer.weight_decay 0.1 -> 0.05" in line
    assert "training.steps 20 -> 30" in line

    def expected_lr(step: int) -> float:
        sched = run.cfg.lr_scheduler
        return 4e-4 * lr_factor(
            step,
            total_steps=30,
            warmup_steps=sched.warmup_steps,
            decay_ratio=sched.decay_ratio,
            decay_type=sched.decay_type,
            min_lr_factor=sched.min_lr_factor,
        )

    (group,) = run.trainer.optimizer.param_groups
    assert group["lr"] == run.sched.get_last_lr()[0] == expected_lr(2)
    assert group["initial_lr"] == 4e-4 and group["weight_decay"] == 0.05 and group["betas"] == (0.9, 0.99)
    run.train(3, 3)
    assert group["lr"] == expected_lr(3)


@pytest.mark.parametrize(
    "over, message",
    [
        ({"model.flavor": "1B"}, "model.flavor was debugmodel, this run has 1B"),
        ({"training.seq_len": 16}, "training.seq_len was 8, this run has 16"),
        ({"training.local_batch_size": 4}, "training.global_batch_size was 2 samples per step, this run has 4 samples"),
        (
            {"training.dataset_virtual_shards": 1},
            "training.dataset_virtual_shards was 2 virtual shards, this run has 1",
        ),
    ],
)
def test_settings_that_cannot_change_stop_the_resume(tmp_path, over, message):
    saved_run(tmp_path, steps=1)
    run = Run(tmp_path, seed=3, over=over)
    before = run.params()
    with pytest.raises(CheckpointError, match="cannot change when resuming") as e:
        run.ckpt.load()
    assert str(e.value).startswith(f"checkpoint {root(tmp_path) / 'step-1'}: {message}") and "\n" not in str(e.value)
    assert all(torch.equal(v, full_state(run.model)[k]) for k, v in before.items())


def test_another_dataset_stops_unless_allowed(tmp_path, caplog):
    saved_run(tmp_path / "run", steps=2)
    other = tmp_path / "other.txt"
    other.write_text("\n\n".join(f"document {i}: " + "some other words " * 20 for i in range(40)))
    with pytest.raises(
        CheckpointError, match=r"training.dataset_path was .*corpus \(12 files, .* this run reads .*other"
    ):
        Run(tmp_path / "run", over={"training.dataset_path": str(other)}).ckpt.load()
    with pytest.raises(CheckpointError, match=r"training.dataset_text_field was 'text', this run has 'body'; its data"):
        Run(tmp_path / "run", over={"training.dataset_text_field": "body"}).ckpt.load()
    run = Run(tmp_path / "run", over={"training.dataset_path": str(other), "training.allow_dataset_change": True})
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        assert run.ckpt.load() == 2
    (message,) = warnings_of(caplog)
    assert "the data stream restarts from the beginning of the new dataset" in message
    fresh = Run(tmp_path / "fresh", over={"training.dataset_path": str(other)})
    assert all(torch.equal(a, b) for a, b in zip(next(iter(run.loader)), next(iter(fresh.loader))))


def test_the_same_dataset_elsewhere_resumes(tmp_path, caplog):
    """The fingerprint is the files' content, not their location or modification times."""
    saved_run(tmp_path / "run", steps=1)
    copy = shutil.copytree(ROOT / "titanlite" / "data" / "corpus", tmp_path / "corpus")
    os.utime(copy / "pydocs_000.txt", (0, 0))
    with caplog.at_level(logging.INFO, logger="titanlite"):
        assert Run(tmp_path / "run", over={"training.dataset_path": str(copy)}).ckpt.load() == 1
    assert f'training.dataset_path "" -> "{copy}"' in caplog.text


def test_another_tokenizer_stops_the_same_one_elsewhere_resumes(tmp_path):
    """Token ids mean something under one vocabulary only: the fingerprint is the file's content."""
    saved_run(tmp_path / "run", steps=1)
    lines = (ROOT / "titanlite" / "data" / "assets" / "pydocs_2k.tiktoken").read_text().splitlines()
    same, other = tmp_path / "same.tiktoken", tmp_path / "other.tiktoken"
    same.write_text("\n".join(lines) + "\n")
    assert Run(tmp_path / "run", over={"model.tokenizer_path": str(same)}).ckpt.load() == 1
    (a, ra), (b, rb) = lines[1000].split(), lines[1001].split()
    lines[1000:1002] = [f"{b} {ra}", f"{a} {rb}"]  # two tokens swap ids
    other.write_text("\n".join(lines) + "\n")
    with pytest.raises(
        CheckpointError, match=rf"model.tokenizer_path was bundled \(digest \w+\), this run has {other}"
    ):
        Run(tmp_path / "run", over={"model.tokenizer_path": str(other)}).ckpt.load()


# --- the data loader's resharding rule, at the loader level -----------------------------------------------


def _step_samples(iters: list, accum: int) -> list[tuple[int, ...]]:
    """The samples of one optimizer step over all dp ranks, each as its token window."""
    out = []
    for it in iters:
        for _ in range(accum):
            inputs, labels, _ = next(it)
            out += [tuple(r) + (lab[-1],) for r, lab in zip(inputs.tolist(), labels.tolist())]
    return sorted(out)


@pytest.mark.parametrize("old_dp, old_tp, new_dp", [(2, 1, 4), (4, 1, 2), (2, 1, 1), (2, 2, 2), (1, 1, 4)])
def test_loader_state_reshards_without_repeats_or_gaps(tmp_path, old_dp, old_tp, new_dp):
    """Steps 1-3 on old_dp ranks, checkpoint through rank_state, steps 4-6 on new_dp: the global batches of
    every step equal an uninterrupted single-rank run's (nothing repeated, nothing skipped)."""
    gbs, lbs = 8, 2
    reference = iter(loader("", lbs=lbs, seq_len=16))
    expected = [_step_samples([reference], gbs // lbs) for _ in range(6)]
    loaders = [loader("", rank=d, dp=old_dp, lbs=lbs, seq_len=16) for d in range(old_dp)]
    iters = [iter(x) for x in loaders]
    got = [_step_samples(iters, gbs // (lbs * old_dp)) for _ in range(3)]
    for rank in range(old_dp * old_tp):  # every tp rank of a dp rank saves the same loader state
        state = rank_state.capture(
            loaders[rank // old_tp], rank=rank, dp_rank=rank // old_tp, dp_degree=old_dp, device=torch.device("cpu")
        )
        rank_state.write(tmp_path, rank, state)
    new = [loader("", rank=d, dp=new_dp, lbs=lbs, seq_len=16) for d in range(new_dp)]
    for d, x in enumerate(new):
        x.load_state_dict(
            rank_state.loader_state_for(
                d, new_dp, WorldLayout(old_dp * old_tp, old_dp, tp=old_tp), lambda r: rank_state.read(tmp_path, r)
            )
        )
    iters = [iter(x) for x in new]
    got += [_step_samples(iters, gbs // (lbs * new_dp)) for _ in range(3)]
    assert got == expected
    flat = [s for step in got for s in step]
    assert len(flat) == len(set(flat)) == 6 * gbs
