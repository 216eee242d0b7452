"""Profiling: the trainer writes per-rank Chrome traces on schedule; memory records on CPU and CUDA."""

from __future__ import annotations

import json

import pytest
import torch

from harness import SHALLOW, SMALL, train
from titanlite.config import Profiling
from titanlite.metrics.profiling import Profiler


def _run(tmp_path, freq: int, start: int, steps: int, **flags) -> list[str]:
    model = torch.nn.Linear(8, 8)
    with Profiler(
        Profiling(profile_freq=freq, **flags), str(tmp_path), rank=3, device=torch.device("cpu"), start_step=start
    ) as profiler:
        for _ in range(steps):
            model(torch.randn(4, 8)).sum().backward()
            profiler.step()
    return [p.removeprefix(str(tmp_path) + "/") for p in profiler.written]


def test_schedule_records_global_multiples_of_the_frequency_after_resume(tmp_path):
    # Resumed after step 4, training steps 5..11: steps 6 and 9 are recorded, nothing else (not the
    # unfinished cycle at the end).
    assert _run(tmp_path, freq=3, start=4, steps=7, enable_profiling=True) == [
        "profile_traces/iteration_6/rank3_trace.json",
        "profile_traces/iteration_9/rank3_trace.json",
    ]


def test_cpu_memory_record_is_the_allocated_bytes_of_the_step(tmp_path):
    written = _run(tmp_path, freq=2, start=0, steps=2, enable_memory_snapshot=True)
    assert written == ["memory_snapshot/iteration_2/rank3_memory_timeline.json"]
    timeline = json.loads((tmp_path / written[0]).read_text())
    assert (timeline["step"], timeline["rank"], timeline["device"]) == (2, 3, "cpu")
    times, sizes = timeline["times_us"], timeline["allocated_bytes"]
    assert len(times) == len(sizes) > 0 and times == sorted(times)
    assert timeline["peak_bytes"] == max(sizes) >= 4 * 8 * 4  # at least the forward's [4, 8] fp32 output
    assert timeline["top_allocating_ops"][0][1] > 0


@pytest.mark.slow
def test_two_ranks_write_traces_and_cpu_memory_timelines_and_train_on(tmp_path):
    """Chrome traces that parse, one per rank and recorded step. torch's own CPU memory timeline fails on
    a multi-rank step's collectives and the profiler's exit then segfaults; two ranks profiled every 2
    steps must train to the end and write one memory timeline per rank and recorded step."""
    run = train(
        tmp_path,
        2,
        *SMALL,
        *SHALLOW,
        "--training.steps",
        "4",
        "--training.local_batch_size",
        "2",
        "--profiling.enable_profiling",
        "--profiling.profile_freq",
        "2",
        "--profiling.enable_memory_snapshot",
        launcher="run_train",
    ).ok()
    assert "memory snapshot is CUDA-only" in run.log and "not written" not in run.log
    assert [r["step"] for r in run.metrics] == [1, 2, 3, 4]
    for step in (2, 4):
        for rank in (0, 1):
            folder = f"iteration_{step}"
            timeline = json.loads(
                (tmp_path / "memory_snapshot" / folder / f"rank{rank}_memory_timeline.json").read_text()
            )
            assert timeline["peak_bytes"] > 0
            assert (tmp_path / "profile_traces" / folder / f"rank{rank}_trace.json").is_file()
    assert sorted(p.name for p in (tmp_path / "profile_traces").iterdir()) == ["iteration_2", "iteration_4"]
    trace = json.loads((tmp_path / "profile_traces" / "iteration_2" / "rank0_trace.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("aten::mm" in n or "aten::addmm" in n for n in names)


def test_disabled_profiling_records_nothing(tmp_path):
    assert _run(tmp_path, freq=1, start=0, steps=2) == []
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the allocator history exists on CUDA only")
def test_cuda_memory_snapshot_is_a_pickle_per_recorded_step(tmp_path):
    import pickle

    model = torch.nn.Linear(8, 8, device="cuda")
    with Profiler(
        Profiling(enable_memory_snapshot=True, profile_freq=2), str(tmp_path), rank=0, device=torch.device("cuda")
    ) as profiler:
        for _ in range(4):
            model(torch.randn(4, 8, device="cuda")).sum().backward()
            profiler.step()
    assert [p.removeprefix(str(tmp_path) + "/") for p in profiler.written] == [
        "memory_snapshot/iteration_2/rank0_memory_snapshot.pickle",
        "memory_snapshot/iteration_4/rank0_memory_snapshot.pickle",
    ]
    with open(profiler.written[0], "rb") as f:
        assert "segments" in pickle.load(f)
