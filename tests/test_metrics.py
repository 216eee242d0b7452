"""Metrics: the GPU peak table (most specific name first; unknown GPUs report no MFU)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from titanlite.config import Metrics
from titanlite.metrics import MetricsLogger, StepStats, peak_tflops


@pytest.mark.parametrize(
    "name,peak",
    [
        ("NVIDIA GB200", 2500.0),
        ("NVIDIA B200", 2250.0),
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA GeForce RTX 3090", None),
    ],
)
def test_gpu_peak_table_matches_the_most_specific_name(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    got, source = peak_tflops(torch.device("cuda", 0))
    assert got == peak
    if peak is None:
        assert "MFU not reported" in source


def test_unknown_gpu_logs_no_mfu(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    logger = MetricsLogger(Metrics(enable_tensorboard=False), str(tmp_path), torch.device("cpu"), 1e6, enabled=True)
    logger.peak, logger.peak_source = peak_tflops(torch.device("cuda", 0))
    with caplog.at_level(logging.INFO, logger="titanlite"):
        record = logger.log(
            StepStats(step=1, loss=2.0, grad_norm=1.0, lr=1e-3, tokens=512, elapsed=1.0, data_time=0.0), 1
        )
    logger.close()
    assert record["mfu_pct"] is None and "mfu: n/a" in caplog.text
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["mfu_pct"] is None
