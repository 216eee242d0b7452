"""scripts/gpu_smoke.sh: its CPU form end to end through run_train.sh, and its verdict logic, including the
negative controls (a resumed loss that differs, a run that did not resume, attention that cannot run)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend

from harness import ROOT, child_env


def _load_gpu_smoke():
    """benchmarks/ is not a package: load the script's module by path."""
    spec = importlib.util.spec_from_file_location("gpu_smoke", ROOT / "benchmarks" / "gpu_smoke.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_smoke"] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


gpu_smoke = _load_gpu_smoke()


def rows(losses: dict[int, float]) -> list[dict]:
    return [
        {"step": s, "loss": x, "tps": 100.0 * s, "mfu_pct": 1.0, "mem_peak_gib": 0.5, "step_time_s": 1.0}
        for s, x in losses.items()
    ]


UNINTERRUPTED = rows({1: 8.1, 2: 8.0, 3: 7.9, 4: 7.85})


def test_resume_is_ok_only_with_the_uninterrupted_losses():
    same = gpu_smoke.compare_resume(UNINTERRUPTED, rows({3: 7.9, 4: 7.85}), 2, 4, rtol=0.0)
    assert same["ok"] and same["bitwise"] and same["max_rel_diff"] == 0.0 and same["steps"] == "3-4"

    off = gpu_smoke.compare_resume(UNINTERRUPTED, rows({3: 7.9, 4: 7.85 * (1 + 1e-6)}), 2, 4, rtol=0.0)
    assert not off["ok"] and "step 4" in off["why"] and off["max_rel_diff"] == pytest.approx(1e-6)
    # Within a tolerance it passes, but is not called bitwise.
    within = gpu_smoke.compare_resume(UNINTERRUPTED, rows({3: 7.9, 4: 7.85 * (1 + 1e-6)}), 2, 4, rtol=1e-3)
    assert within["ok"] and not within["bitwise"]

    # A run that trained from scratch instead of resuming logs steps 1-4: it fails whatever its losses.
    fresh = gpu_smoke.compare_resume(UNINTERRUPTED, UNINTERRUPTED, 2, 4, rtol=1e-3)
    assert not fresh["ok"] and fresh["why"] == "the resumed run logged steps 1-4, expected 3-4"
    nan = gpu_smoke.compare_resume(UNINTERRUPTED, rows({3: 7.9, 4: math.nan}), 2, 4, rtol=1e-3)
    assert not nan["ok"] and nan["max_rel_diff"] == math.inf


def result_of(resumed: list[dict], form: str = "cpu") -> dict:
    """A smoke-test result as `smoke` assembles it, for the given resumed rows."""
    on_gpu = form == "gpu"
    result = {
        "form": form,
        "environment": {
            "torch": torch.__version__,
            "cuda": "12.8" if on_gpu else None,
            "device": "NVIDIA H200" if on_gpu else "cpu",
            "capability": "sm_90" if on_gpu else None,
            "memory_gib": 139.8 if on_gpu else None,
            "bf16": True if on_gpu else None,
        },
        "flash_attention": {"ok": True, "detail": "ok"} if on_gpu else {"ok": None, "detail": "n/a (cpu)"},
        "config_name": "llama3_1b_gpu.toml",
        "flavor": "debugmodel",
        "steps": 4,
        "resume_step": 2,
        "warmup": 2,
        **gpu_smoke.throughput(UNINTERRUPTED, warmup=2),
        "memory_kind": "cuda max allocated" if on_gpu else "cpu peak RSS",
        "peak_source": "",
        "estimate_gib": 0.6,
        "compile_seconds": 1.0,
        "resume": gpu_smoke.compare_resume(UNINTERRUPTED, resumed, 2, 4, rtol=0.0),
        "runs": {
            "run": {"returncode": 0, "timed_out": False, "wall_s": 10.0, "steps_logged": 4, "losses_finite": True}
        },
        "wall_s": 20.0,
    }
    result["checks"] = gpu_smoke.checks(result)
    result["passed"] = gpu_smoke.passed(result["checks"])
    return result


def test_a_loss_mismatch_fails_the_smoke_test_with_exit_code_1(tmp_path, monkeypatch, capsys):
    good = result_of(rows({3: 7.9, 4: 7.85}))
    assert good["passed"] and good["checks"]["resume"] and good["checks"]["memory"] is None
    bad = result_of(rows({3: 7.9, 4: 7.86}))
    assert not bad["passed"] and bad["checks"]["resume"] is False
    assert gpu_smoke.passed({**bad["checks"], "resume": True})  # the mismatch is the only failure

    out = tmp_path / "verdict.json"
    monkeypatch.setattr(gpu_smoke, "smoke", lambda argv: {**bad, "json": str(out)})
    assert gpu_smoke.main([]) == 1
    table = capsys.readouterr().out
    assert "resume from step 2" in table and "FAILED" in table and "verdict: FAIL" in table
    assert json.loads(out.read_text())["resume"]["ok"] is False
    monkeypatch.setattr(gpu_smoke, "smoke", lambda argv: {**good, "json": str(out)})
    assert gpu_smoke.main([]) == 0


def test_on_a_gpu_memory_above_the_estimate_or_unusable_flash_attention_fail():
    ok = result_of(rows({3: 7.9, 4: 7.85}), form="gpu")
    assert ok["passed"] and ok["checks"]["memory"] and ok["checks"]["flash_attention"]
    over = {**ok, "peak_gib": ok["estimate_gib"] * (1 + gpu_smoke.MEMORY_SLACK) * 1.01}
    assert gpu_smoke.checks(over)["memory"] is False and not gpu_smoke.passed(gpu_smoke.checks(over))
    no_flash = {**ok, "flash_attention": {"ok": False, "detail": "failed"}}
    assert not gpu_smoke.passed(gpu_smoke.checks(no_flash))
    # A GPU missing from the peak table has no MFU (the trainer does not guess a peak): not a failure.
    assert gpu_smoke.passed(gpu_smoke.checks({**ok, "mfu_pct": None}))
    assert "verdict: PASS" in gpu_smoke.table({**ok, "mfu_pct": None, "peak_source": "n/a: unknown GPU"})


def test_flash_check_runs_the_model_attention_and_reports_a_backend_that_cannot():
    # The CPU has a flash attention kernel too: the check's code path runs here as on a GPU.
    ok, detail = gpu_smoke.flash_check(16, 8, 16, torch.device("cpu"), seq_len=32)
    assert ok, detail
    assert detail.startswith("ok (flash_attention, bf16, 16/8 heads, head dim 16")
    ok, detail = gpu_smoke.flash_check(16, 8, 16, torch.device("cpu"), backend=SDPBackend.CUDNN_ATTENTION, seq_len=32)
    assert not ok and detail.startswith("failed (cudnn_attention")


DEV_TOOLS = ("pytest", "_pytest", "ruff", "importlinter")


def without_dev_tools(folder: Path, mark: Path) -> str:
    """A PYTHONPATH entry under which the dev tools cannot be imported, as where they are not installed: each
    import attempt is recorded in `mark` and fails."""
    for name in DEV_TOOLS:
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(
            f"with open({str(mark)!r}, 'a') as f:\n    f.write({name!r} + '\\n')\n"
            f"raise ImportError('no module named {name} (a dev tool; training must not need it)')\n"
        )
    return str(folder)


@pytest.mark.slow
def test_gpu_smoke_cpu_form_trains_resumes_and_passes(tmp_path):
    out, dump = tmp_path / "smoke.json", tmp_path / "dump"
    # The GPU image has no pytest, ruff or import-linter: neither the script, nor set-up, nor the ranks need them.
    mark = tmp_path / "dev_tool_imports.txt"
    env = child_env(PYTHON=sys.executable)
    env["PYTHONPATH"] = without_dev_tools(tmp_path / "nodev", mark) + os.pathsep + env["PYTHONPATH"]
    proc = subprocess.run(
        ["scripts/gpu_smoke.sh", "--json", str(out), "--dump", str(dump), "--quiet"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert not mark.exists(), mark.read_text()
    r = json.loads(out.read_text())
    assert r["passed"] and r["form"] == "cpu" and r["steps"] == 4 and r["resume_step"] == 2
    assert r["checks"] == {
        "bf16": None,
        "flash_attention": None,
        "training": True,
        "throughput": True,
        "memory": None,
        "compile": True,
        "resume": True,
    }
    assert r["resume"]["bitwise"] and r["resume"]["steps"] == "3-4" and r["flash_attention"]["detail"] == "n/a (cpu)"
    assert r["tokens_per_s"] > 0 and r["mfu_pct"] > 0 and r["peak_gib"] > 0 and r["estimate_gib"] > 0
    assert r["compile_seconds"] > 0 and r["flavor"] == "debugmodel"
    assert [run["returncode"] for run in r["runs"].values()] == [0, 0]
    assert "verdict: PASS" in proc.stdout and "resume from step 2" in proc.stdout
    # Both launches went through run_train.sh; the resumed one started from the step-2 checkpoint alone.
    assert r["runs"]["resume"]["command"][0].endswith("run_train.sh")
    assert "resumed from" in (dump / "resume.log").read_text()
    # A passing smoke test removes its checkpoints (a 1B checkpoint is 12 GB); the metrics stay.
    assert not (dump / "run" / "checkpoint").exists() and (dump / "resume" / "metrics.jsonl").exists()
