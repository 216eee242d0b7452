"""NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME: the names they accept, a name the node lacks refused by the
launcher in one line before any rank starts, and the settings reaching the ranks through run_train.sh."""

from __future__ import annotations

import pytest

from harness import SMALL, train
from titanlite.errors import ConfigError
from titanlite.run.socket_interfaces import check, problem

NODE = ["lo", "eth0", "ib0", "ib1", "docker0"]


@pytest.mark.parametrize(
    "var,value,ok",
    [
        ("NCCL_SOCKET_IFNAME", "ib", True),  # a prefix
        ("NCCL_SOCKET_IFNAME", "eth0,ib0", True),
        ("NCCL_SOCKET_IFNAME", "=ib", False),  # exact names only
        ("NCCL_SOCKET_IFNAME", "=ib1", True),
        ("NCCL_SOCKET_IFNAME", "^docker,lo", True),  # an exclusion list
        ("NCCL_SOCKET_IFNAME", "enp", False),
        ("GLOO_SOCKET_IFNAME", "eth0", True),
        ("GLOO_SOCKET_IFNAME", "eth0,ib0", True),
        ("GLOO_SOCKET_IFNAME", "eth", False),  # gloo takes no prefixes
        ("GLOO_SOCKET_IFNAME", "eth0,eth1", False),
    ],
)
def test_interface_names_as_nccl_and_gloo_read_them(var, value, ok):
    assert (problem(var, value, NODE) is None) == ok


def test_a_name_the_node_lacks_is_one_config_error_naming_its_interfaces():
    check({"NCCL_SOCKET_IFNAME": "ib", "GLOO_SOCKET_IFNAME": "eth0"}, NODE)
    with pytest.raises(ConfigError, match=r"^GLOO_SOCKET_IFNAME=eth1 names 'eth1', which this node does not have "):
        check({"GLOO_SOCKET_IFNAME": "eth1"}, NODE)


@pytest.mark.slow
def test_the_settings_reach_the_ranks_and_a_missing_interface_stops_the_launch(tmp_path):
    """Through run_train.sh with 2 ranks: gloo bootstraps over `lo` as named and rank 0 reports both
    settings; a name the node lacks is one line, exit code 2, and no rank starts (no dump folder)."""
    run = ["--training.steps", "1", *SMALL]
    ok = train(
        tmp_path / "ok", 2, *run, launcher="run_train", env={"NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}
    ).ok()
    assert "[rank0]: " in ok.log and "network interfaces: NCCL_SOCKET_IFNAME=lo, GLOO_SOCKET_IFNAME=lo" in ok.log
    bad = train(tmp_path / "bad", 2, *run, launcher="run_train", env={"GLOO_SOCKET_IFNAME": "nosuch0"})
    lines = bad.stderr.splitlines()
    assert bad.returncode == 2 and len(lines) == 1, bad.stderr
    assert lines[0].startswith("titanlite: error: GLOO_SOCKET_IFNAME=nosuch0 names 'nosuch0', which this node")
    assert not (tmp_path / "bad").exists()
