"""What replica groups refuse before anything runs, in one line and exit code 2: fault tolerance without
torchft (its `ft` extra), and the lighthouse tool without torchft, on a port that is taken, or with no
group to wait for. The launcher's table of bad configs (tests/runs/test_bad_input.py) holds the rest."""

from __future__ import annotations

import importlib.util
import signal
import socket
import subprocess
import sys
import time

import pytest
from replica_groups import free_port

from harness import ROOT, child_env
from titanlite.errors import run_cli
from titanlite.launcher import preflight
from titanlite.tools import lighthouse

FT2 = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]


@pytest.fixture
def without_torchft(monkeypatch):
    """torchft looked up as not installed; every other package as it is."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else find_spec(name, *a)
    )


def preflight_err(tmp_path, monkeypatch, capsys, *overrides: str) -> tuple[int, str]:
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = ["--config", str(ROOT / "train_configs/debug_model.toml"), "--job.dump_folder", str(tmp_path), *overrides]
    code = run_cli(preflight.main, args)
    return code, capsys.readouterr().err.strip()


def test_fault_tolerance_without_torchft_names_the_ft_extra(tmp_path, monkeypatch, capsys, without_torchft):
    code, err = preflight_err(tmp_path, monkeypatch, capsys, *FT2)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "fault_tolerance.enable needs torchft" in err and "TITANLITE_EXTRAS=ft" in err, err


def test_fault_tolerance_with_torchft_passes_the_preflight(tmp_path, monkeypatch, capsys):
    # The negative control: the same settings with torchft installed (this environment's) are no error.
    code, err = preflight_err(tmp_path, monkeypatch, capsys, *FT2)
    assert code == 0 and "error" not in err, err


def lighthouse_err(capsys, *argv: str) -> tuple[int, str]:
    code = run_cli(lighthouse.main, list(argv))
    return code, capsys.readouterr().err


def test_the_lighthouse_without_torchft_names_the_ft_extra(capsys, without_torchft):
    code, err = lighthouse_err(capsys, "--min_replicas", "1", "--port", "1")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("titanlite: error: the lighthouse is torchft's") and "TITANLITE_EXTRAS=ft" in err, err


def test_the_lighthouse_refuses_a_quorum_of_no_group(capsys):
    code, err = lighthouse_err(capsys, "--min_replicas", "0")
    assert (code, err) == (2, "titanlite: error: --min_replicas 0: at least 1\n")


def start_lighthouse(port: int) -> subprocess.Popen:
    """The tool as users start it, in its own process: a bug that served would block a test process."""
    cmd = [sys.executable, "-m", "titanlite.tools.lighthouse", "--min_replicas", "1", "--port", str(port)]
    return subprocess.Popen(cmd, env=child_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_the_lighthouse_on_a_taken_port_is_one_line():
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = start_lighthouse(port)
        try:
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert (proc.returncode, out, err.count("\n")) == (2, "", 1), err
    assert err.startswith(f"titanlite: error: lighthouse: cannot serve on [::]:{port} (Address already in use"), err


@pytest.mark.slow
def test_the_lighthouse_on_a_free_port_serves_until_sigterm():
    # The negative control of the taken port: the same command on a free one serves, and stops cleanly.
    port = free_port()
    proc = start_lighthouse(port)
    try:
        line = proc.stdout.readline()
        assert line.startswith("lighthouse: serving on http://") and f":{port} " in line, line
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert (proc.returncode, out, err) == (0, "lighthouse: stopped\n", ""), err
