"""Metrics: the GPU peak table (most specific name first; unknown GPUs report no MFU), the CPU peak
measured once per machine, the step line, and the dashboards (TensorBoard read back as its server reads
it, W&B read back from an offline run's file)."""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from harness import ROOT, child_env
from titanlite import metrics
from titanlite.config import Metrics
from titanlite.errors import run_cli
from titanlite.launcher import preflight
from titanlite.metrics import METRICS, MetricsLogger, StepStats, ValidationResult, mfu, peak_tflops
from titanlite.metrics.goodput import BADPUT
from titanlite.metrics.runs import layout_label
from titanlite.tools.dashboard import describe, read_dashboard


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
    logger.peak = mfu.Peak(0.0, torch.device("cuda", 0))
    with caplog.at_level(logging.INFO, logger="titanlite"):
        record = logger.log(
            StepStats(step=1, loss=2.0, grad_norm=1.0, lr=1e-3, tokens=512, elapsed=1.0, data_time=0.0), 1
        )
    logger.close()
    assert record["mfu_pct"] is None and "mfu: n/a" in caplog.text
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["mfu_pct"] is None


def rows() -> list[StepStats]:
    return [
        StepStats(
            step=s,
            loss=3.0 / s,
            grad_norm=0.5 * s,
            lr=1e-3 * s,
            tokens=512 * s,
            elapsed=0.25,
            data_time=0.01 * s,
            goodput={"goodput": 0.5 + s / 100, **{f"badput/{c.name}": 0.1 * s for c in BADPUT}},
        )
        for s in (1, 10, 20)
    ]


def log_rows(cfg: Metrics, dump: Path, **kw) -> tuple[list[dict], list[str]]:
    """Log three steps of a 20-step run with a fixed MFU peak; returns the metrics.jsonl rows and the console lines."""
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("titanlite").addHandler(handler)
    logging.getLogger("titanlite").setLevel(logging.INFO)
    try:
        logger = MetricsLogger(cfg, str(dump), torch.device("cpu"), 1e6, enabled=True, **kw)
        logger.begin(0, 20)
        for s in rows():
            logger.log(s, 1)
            if kw.get("validation"):
                logger.log_validation(s.step, ValidationResult(loss=6.0 - s.step / 10, seconds=0.5, tokens=4096))
        logger.close()
    finally:
        logging.getLogger("titanlite").removeHandler(handler)
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return records, [m for m in messages if m.lstrip("\x1b[0123456789m").startswith("step ")]


def test_dashboard_shows_every_logged_metric_with_its_name_unit_and_description(tmp_path, caplog):
    """Read back as TensorBoard's server reads the event files: every scalar is the scalars plugin's
    (TensorBoard's loader warns of none "not associated with a plugin"), the custom layout holds exactly
    the logged tags, each with its display name and description, and the values equal metrics.jsonl's
    under one name."""
    rows, _ = log_rows(Metrics(peak_tflops=0.5), tmp_path, validation=True)
    [run] = (tmp_path / "tb").iterdir()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with caplog.at_level(logging.WARNING, logger="tensorboard"):
        board = read_dashboard(str(run))  # the loader of TensorBoard's server
        legacy = EventAccumulator(str(run))  # and its older loader, which warns of scalars without a plugin
        legacy.Reload()
    assert not [r for r in caplog.records if r.name.startswith("tensorboard")], caplog.text
    for m in METRICS:
        # A family's: tests/unit/models/test_qwen3_moe.py; a replica group's: tests/runs/test_replica_groups.py.
        if not m.cuda_only and not m.family and not m.straggler and not m.replicas:
            meta = legacy.SummaryMetadata(m.tag)
            assert (meta.plugin_data.plugin_name, meta.display_name) == ("scalars", m.display_name)
            assert meta.summary_description == m.description
    logged = {m.tag: m for m in METRICS if not m.cuda_only and not m.family and not m.straggler and not m.replicas}
    records = [r for r in rows if "loss" in r]
    val_records = [r for r in rows if "val_loss" in r]
    assert set(board.scalars) == set(logged)
    assert sorted(t for charts in board.layout.values() for tags in charts.values() for t in tags) == sorted(logged)
    assert list(board.layout) == ["loss", "throughput", "memory", "time", "goodput", "badput", "validation"]
    for tag, m in logged.items():
        assert board.scalars[tag].display_name == m.display_name and board.scalars[tag].description
        # `<group>/<name>`, or the name where it begins with its group (`badput/startup`)
        assert tag in (f"{m.group}/{m.name}", m.name) and board.layout[m.group][m.display_name] == [tag]
        got = [v for _, v in board.scalars[tag].values]
        expected = [r[m.name] for r in (val_records if m.validation else records)]
        assert len(got) == 3 and got == pytest.approx(expected, rel=1e-6), tag
    assert board.scalars["throughput/mfu_pct"].values[0][1] == pytest.approx(100 * 512 * 1e6 / 0.25 / 1e12 / 0.5)
    assert board.layout["loss"]["Training loss (nats/token)"] == ["loss/loss"]
    # docs/metrics.md describes the dashboards as this reader prints them.
    page = (Path(__file__).resolve().parents[3] / "docs" / "metrics.md").read_text()
    assert "```\n" + describe(board) + "\n```" in page
    # The old metrics.jsonl keys still read the same values (for one release).
    assert all(r["mfu"] == r["mfu_pct"] and r["data_time_pct"] == r["data_pct"] for r in records)
    assert {r["run"] for r in rows} == {1}


def test_step_line_shows_progress_elapsed_and_eta_without_colour_off_a_terminal(tmp_path, monkeypatch):
    _, lines = log_rows(Metrics(enable_tensorboard=False, peak_tflops=0.5), tmp_path / "a")
    assert [line[:10] for line in lines] == ["step  1/20", "step 10/20", "step 20/20"]
    assert all(re.search(r"elapsed \d+:\d\d:\d\d  eta \d+:\d\d:\d\d$", line) for line in lines)
    assert lines[-1].endswith("eta 0:00:00")
    assert not any("\x1b" in line for line in lines)
    # The negative control: on a terminal the line is coloured, unless colours are disabled.
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    _, coloured = log_rows(Metrics(enable_tensorboard=False, peak_tflops=0.5), tmp_path / "b")
    assert all("\x1b[" in line for line in coloured)
    cfg = Metrics(enable_tensorboard=False, peak_tflops=0.5, disable_color_printing=True)
    assert not any("\x1b" in line for line in log_rows(cfg, tmp_path / "c")[1])


@pytest.mark.parametrize("compiled", [False, True])
def test_eta_is_the_mean_step_time_after_the_first_log(monkeypatch, compiled):
    """The first log's window holds the first step: under compile all it measured is the compilation,
    so it gives no ETA (a 2-minute run showed 0:23:23); eager, that step's time is the estimate."""
    now = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    cfg = Metrics(enable_tensorboard=False)
    logger = MetricsLogger(cfg, "", torch.device("cpu"), 1e6, enabled=False, compiled=compiled)
    logger.begin(0, 100)
    assert logger._eta(1, window_step_s=5.0) == (None if compiled else pytest.approx(99 * 5.0))
    now[0] = 120.0
    assert logger._eta(11, window_step_s=9.0) == pytest.approx(89 * 2.0)  # 20 s over 10 steps
    assert metrics.clock(3725.4) == "1:02:05"


def test_cpu_peak_is_measured_once_per_machine_and_mfu_never_exceeds_100(tmp_path, monkeypatch, caplog):
    """MFU must not drift between runs: the second start reads the first one's measurement. A measurement
    taken on a busy machine is too low: a step faster than it raises the peak (and the cache)."""
    measured, measure = iter([0.07, 0.03]), mfu._measure_cpu_peak_tflops
    monkeypatch.setattr(mfu, "CPU_PEAK_CACHE", str(tmp_path / "peak.json"))
    monkeypatch.setattr(mfu, "_measure_cpu_peak_tflops", lambda: next(measured))
    mfu._cpu_peak_tflops.cache_clear()
    try:
        first = peak_tflops(torch.device("cpu"))[0]
        mfu._cpu_peak_tflops.cache_clear()  # a new process
        assert peak_tflops(torch.device("cpu"))[0] == first == 0.07
        (tmp_path / "peak.json").unlink()
        mfu._cpu_peak_tflops.cache_clear()
        assert peak_tflops(torch.device("cpu"))[0] == 0.03  # deleting the cache measures again
        peak = mfu.Peak(0.0, torch.device("cpu"))
        assert peak.mfu(0.015) == pytest.approx(50.0)
        with caplog.at_level(logging.INFO, logger="titanlite"):
            assert peak.mfu(0.06) == 100.0 and peak.mfu(0.03) == pytest.approx(50.0)
        assert "MFU peak raised from 0.03 to 0.06 TFLOP/s" in caplog.text
        mfu._cpu_peak_tflops.cache_clear()
        assert peak_tflops(torch.device("cpu"))[0] == 0.06  # the next start uses the raised peak
    finally:
        mfu._cpu_peak_tflops.cache_clear()
    configured = MetricsLogger(
        Metrics(enable_tensorboard=False, peak_tflops=2.0), str(tmp_path), torch.device("cpu"), 1, True
    )
    configured.close()
    assert (configured.peak.tflops, configured.peak.source) == (2.0, "metrics.peak_tflops")
    assert measure() > 0  # the real measurement runs


def wandb_records(run_dir: Path) -> list:
    """The records of an offline W&B run file (`run-<id>.wandb`: a ':W&B' header, then the LevelDB log
    format: 32 KiB blocks of records with a 7-byte header (CRC-32C, length, type: 1 full, 2 first,
    3 middle, 4 last), each a serialized wandb `Record` protobuf)."""
    from wandb.proto import wandb_internal_pb2

    [path] = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, records, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the block's tail is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            records.append(record)
            buf = b""
    return records


def test_wandb_offline_run_holds_the_same_scalars_as_tensorboard(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = Metrics(peak_tflops=0.5, enable_wandb=True, wandb_project="proj", wandb_run_name="shape-study")
    records, _ = log_rows(cfg, tmp_path / "dump", run_config={"training": {"steps": 20}})
    [run_dir] = (tmp_path / "wandb_dir" / "wandb").glob("offline-run-*")
    # wandb's service process writes the file and may still be flushing when finish() returns.
    deadline = time.monotonic() + 60
    while True:
        run_file = wandb_records(run_dir)
        if run_file and run_file[-1].WhichOneof("record_type") == "exit":
            break
        assert time.monotonic() < deadline, "the offline run file was not completed"
        time.sleep(0.1)
    history, run = [], None
    for r in run_file:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history.append({k: v for k, v in items.items() if not k.startswith("_")})
        elif r.WhichOneof("record_type") == "run":
            run = r.run
    assert run.project == "proj" and run.display_name == "shape-study"
    assert {u.key: json.loads(u.value_json) for u in run.config.update}["training"] == {"steps": 20}
    [tb] = (tmp_path / "dump" / "tb").iterdir()
    board = read_dashboard(str(tb))
    assert [set(h) for h in history] == [set(board.scalars)] * 3
    for tag, scalar in board.scalars.items():
        assert [h[tag] for h in history] == pytest.approx([v for _, v in scalar.values], rel=1e-6), tag
    assert [h["loss/loss"] for h in history] == [r["loss"] for r in records]


def test_wandb_enabled_but_missing_is_one_line_and_exit_code_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # an environment without the package
    argv = ["--config", "train_configs/debug_model.toml", "--metrics.enable_wandb", "--job.dump_folder", str(tmp_path)]
    assert run_cli(preflight.main, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "titanlite: error: metrics.enable_wandb is set but the wandb package is not installed "
        "(pip install 'titanlite[wandb]', or --no-metrics.enable_wandb)"
    ]
    assert run_cli(preflight.main, argv[:2] + argv[3:]) == 0  # the same run without W&B passes


def test_rows_name_their_run_and_a_torn_last_row_is_cut(tmp_path):
    """Each trainer start is a new `run` in metrics.jsonl: a resumed run's repeated steps are told apart."""
    log_rows(Metrics(enable_tensorboard=False, peak_tflops=0.5), tmp_path)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 21, "loss": 1.')  # a crash in the middle of a row
    rows, _ = log_rows(Metrics(enable_tensorboard=False, peak_tflops=0.5), tmp_path)
    assert [(r["run"], r["step"]) for r in rows] == [(1, 1), (1, 10), (1, 20), (2, 1), (2, 10), (2, 20)]


def test_runs_are_numbered_once_named_by_layout_and_listed(tmp_path):
    """Every run that starts training takes the next number, even one that dies before its first row
    (the next run must not print the same number), and is listed in runs.jsonl under the name of its
    TensorBoard folder; a start that trains nothing writes nothing."""
    cfg = Metrics(peak_tflops=0.5)

    def start(from_step: int, label: str, world: int, log: bool = True) -> MetricsLogger:
        logger = MetricsLogger(cfg, str(tmp_path), torch.device("cpu"), 1e6, True, run_label=label, world_size=world)
        logger.begin(from_step, 20)
        if log:
            logger.log(rows()[0], 1)
        logger.close()
        return logger

    idle = MetricsLogger(cfg, str(tmp_path), torch.device("cpu"), 1e6, True)  # resumed at its last step
    idle.close()
    assert not list(tmp_path.iterdir())
    start(0, "dp_shard2", 2)
    start(10, "dp_shard2-tp2-compile", 4, log=False)  # killed in its first step
    start(10, "1proc", 1)
    listed = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    names = ["run001-dp_shard2", "run002-dp_shard2-tp2-compile-from_step10", "run003-1proc-from_step10"]
    assert [(r["run"], r["name"], r["from_step"], r["world_size"]) for r in listed] == [
        (1, names[0], 0, 2),
        (2, names[1], 10, 4),
        (3, names[2], 10, 1),
    ]
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == names
    assert [json.loads(line)["run"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 3]
    assert layout_label({"dp_shard": 1}, "fsdp2", False, "ep2") == "1proc-ep2-fsdp2"


class FailingWandb:
    name = "fake"

    def __init__(self):
        self.calls = 0

    def log(self, scalars, step):
        self.calls += 1
        raise OSError(28, "No space left on device")

    def finish(self):
        raise OSError(28, "No space left on device")


def test_an_output_that_fails_is_warned_about_once_and_training_goes_on(tmp_path, monkeypatch, caplog):
    """W&B fails at once, metrics.jsonl at its second row (a short write, then ENOSPC): one warning each,
    no torn row, and TensorBoard goes on."""
    logger = MetricsLogger(Metrics(peak_tflops=0.5), str(tmp_path), torch.device("cpu"), 1e6, enabled=True)
    logger.begin(0, 20)
    logger.sinks.wandb_run = wandb = FailingWandb()
    write, writes = os.write, []

    def full_after_one_row(fd, data):
        if fd == logger.sinks.jsonl.fd and writes:
            if len(writes) == 1:
                writes.append(data)
                return write(fd, bytes(data[:7]))  # a short write, as a disk filling up gives
            raise OSError(28, "No space left on device")
        writes.append(data)
        return write(fd, data)

    monkeypatch.setattr(os, "write", full_after_one_row)
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        for s in rows():
            logger.log(s, 1)
        logger.close()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2, warned  # W&B (its first write) and metrics.jsonl (its second): TensorBoard had room
    assert warned[1].startswith("metrics: cannot write metrics.jsonl (OSError: [Errno 28] No space left on device)")
    assert warned[1].endswith("nothing more is written to it in this run, training continues")
    assert "cannot write the W&B run" in warned[0] and wandb.calls == 1
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]
    [run] = (tmp_path / "tb").iterdir()
    assert [step for step, _ in read_dashboard(str(run)).scalars["loss/loss"].values] == [1, 10, 20]


def test_dashboard_takes_the_tensorboard_folder_and_refuses_a_missing_one_in_one_line(tmp_path):
    """`python -m titanlite.tools.dashboard` as the docs run it: on `<dump_folder>/tb` it shows the newest
    run and names it; a folder that does not exist is one line and exit code 2 (not a traceback)."""
    log_rows(Metrics(peak_tflops=0.5), tmp_path)
    log_rows(Metrics(peak_tflops=0.5), tmp_path)

    def dashboard(folder: Path) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "titanlite.tools.dashboard", str(folder)]
        return subprocess.run(cmd, env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)

    missing = dashboard(tmp_path / "nope")
    assert (missing.returncode, missing.stdout) == (2, ""), missing.stderr[-3000:]
    assert missing.stderr.splitlines() == [
        f"titanlite: error: {tmp_path / 'nope'} does not exist (give <dump_folder>/tb or one run folder in it)"
    ]
    tb = dashboard(tmp_path / "tb")
    assert (tb.returncode, tb.stderr) == (0, ""), tb.stderr[-3000:]
    lines = tb.stdout.splitlines()
    assert lines[0] == f"run002-1proc (the newest run in {tmp_path / 'tb'}):"
    one = dashboard(tmp_path / "tb" / "run001-1proc")
    assert one.returncode == 0 and one.stdout.splitlines() == lines[1:] and len(lines) == 25, one.stdout
