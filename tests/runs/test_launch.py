"""The launch command lines (titanlite.launcher.launch with torchrun's options) that run_train.sh and
multinode_trainer.slurm run (DRY_LAUNCH=1 prints it)."""

from __future__ import annotations

import json
import math
import re
import shlex
import socket
import subprocess

import pytest

from harness import ROOT, SMALL, child_env

FAKE_SRUN = """#!/bin/bash
# Records each call's options as one line, then runs the task of node 0 (what srun starts on every node).
options=()
while [[ "$1" == --* ]]; do options+=("$1"); shift; done
echo "${options[*]}" >> "$SRUN_LOG"
SLURM_NODEID=0 exec "$@"
"""
FAKE_HOSTNAME = """#!/bin/bash
# The head node's addresses (documentation ranges: nothing is sent to them).
[ "$1" = "--ip-address" ] && echo "192.0.2.7 2001:db8::7 "
"""
FAKE_SCONTROL = """#!/bin/bash
[ "$1 $2" = "show hostnames" ] && [ "$3" = "node[001-002]" ] && printf 'node001\\nnode002\\n'
"""


def launched(proc: subprocess.CompletedProcess) -> list[str]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return shlex.split(proc.stdout.strip().splitlines()[-1])


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.slow
def test_two_nodes_use_the_c10d_rendezvous():
    env = child_env(NNODES="2", NGPU="2", RDZV_ENDPOINT="node001:29500", RDZV_ID="job7", DRY_LAUNCH="1")
    argv = launched(
        subprocess.run(
            ["./run_train.sh", "--training.steps", "5"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
        )
    )
    assert argv[0].startswith("OMP_NUM_THREADS=") and argv[2:4] == ["-m", "titanlite.launcher.launch"]
    assert "--standalone" not in argv
    assert (
        option(argv, "--nnodes"),
        option(argv, "--rdzv_backend"),
        option(argv, "--rdzv_endpoint"),
        option(argv, "--rdzv_id"),
    ) == ("2", "c10d", "node001:29500", "job7")
    assert "--nproc_per_node=2" in argv
    assert argv[-6:] == [
        "-m",
        "titanlite.train",
        "--config",
        str(ROOT / "train_configs/debug_model.toml"),
        "--training.steps",
        "5",
    ]


def slurm_env(tmp_path) -> dict[str, str]:
    """A SLURM job's environment on this machine: fake srun, scontrol and hostname, two nodes of 2 "GPUs" (this CPU
    machine stands in for them), the launch printed instead of run (DRY_LAUNCH=1)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("hostname", FAKE_HOSTNAME)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = child_env(
        PATH=f"{bin_dir}:{child_env()['PATH']}",
        SRUN_LOG=str(tmp_path / "srun.log"),
        DRY_LAUNCH="1",
        SLURM_JOB_NODELIST="node[001-002]",
        SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_ID="1234",
        SLURM_GPUS_ON_NODE="2",
        SLURM_CPUS_ON_NODE="16",
        SLURM_SUBMIT_DIR=str(ROOT),
        TITANLITE_DEVICE="cpu",  # this CPU machine stands in for the GPU nodes SLURM_GPUS_ON_NODE names
    )
    for key in ("NGPU", "NNODES", "RDZV_ENDPOINT", "RDZV_ID", "RDZV_HOST"):
        env.pop(key, None)
    return env


@pytest.mark.slow
@pytest.mark.parametrize(("rdzv_host", "endpoint"), [(None, "192.0.2.7:29500"), ("2001:db8::9", "[2001:db8::9]:29500")])
def test_slurm_script_starts_one_agent_per_node_at_the_head_node(tmp_path, rdzv_host, endpoint):
    """The agents meet at the head node's address as the head node reports it (a host name may resolve to
    another interface on each node), or at RDZV_HOST; an IPv6 address is bracketed before the port."""
    env = slurm_env(tmp_path)
    if rdzv_host:
        env["RDZV_HOST"] = rdzv_host
    argv = launched(
        subprocess.run(
            ["bash", str(ROOT / "multinode_trainer.slurm"), "--training.steps", "5"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    )
    # The head node is asked for its address (unless RDZV_HOST names one), then one agent starts per node.
    lookup = [] if rdzv_host else ["--nodes=1 --ntasks=1 --nodelist=node001"]
    assert (tmp_path / "srun.log").read_text().splitlines() == [
        *lookup,
        "--nodes=2 --ntasks-per-node=1 --cpus-per-task=16 --cpu-bind=none --kill-on-bad-exit=1",
    ]
    assert option(argv, "--comm.stop_grace_seconds") == "270"
    assert (option(argv, "--nnodes"), option(argv, "--rdzv_endpoint"), option(argv, "--rdzv_id")) == (
        "2",
        endpoint,
        "titanlite-1234",
    )
    assert "--nproc_per_node=2" in argv and argv[-2:] == ["--training.steps", "5"]


@pytest.mark.slow
def test_a_replica_groups_slurm_job_is_a_multinode_run_as_group_k(tmp_path):
    """replica_group.slurm K G runs multinode_trainer.slurm as replica group K of G into its own dump folder;
    without TORCHFT_LIGHTHOUSE it stops in one line, exit 2."""
    env = slurm_env(tmp_path)
    run = ["bash", str(ROOT / "replica_group.slurm"), "1", "2", "--training.steps", "5"]
    missing = subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and len(missing.stderr.splitlines()) == 1 and "TORCHFT_LIGHTHOUSE" in missing.stderr
    env["TORCHFT_LIGHTHOUSE"] = "http://192.0.2.8:29510"
    argv = launched(subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300))
    assert "--nproc_per_node=2" in argv and option(argv, "--nnodes") == "2"
    assert option(argv, "--fault_tolerance.replica_id") == "1" and option(argv, "--fault_tolerance.group_size") == "2"
    assert "--fault_tolerance.enable" in argv and option(argv, "--job.dump_folder") == "outputs/replica_groups/group1"


@pytest.mark.slow
def test_gpu_check_runs_its_cpu_fallback_and_compares_with_the_estimate(tmp_path):
    """Its three cases (bf16, float8 tensorwise with float8 gathers, float8 rowwise: emulated on CPU), each
    in a process of its own, in one table; a case that fails is a row with its one-line reason and the
    exit code is its own."""
    out = tmp_path / "gpu_check.json"
    # Compilation is left out here for time; the same script compiles with aot_eager by default on CPU.
    args = ["scripts/gpu_check.sh", "--steps", "2", "--warmup", "1", "--no-compile.enable"]
    proc = subprocess.run(
        [*args, "--json", str(out)], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MFU n/a (not defined on a CPU)" in proc.stdout and "of 0 TFLOP/s" not in proc.stdout, proc.stdout
    assert "vs dry-run estimate" in proc.stdout and "float8 emulated on a CPU" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split(" | ")[0] for row in rows[1:]] == [
        "| bf16",
        "| float8 tensorwise + float8 all-gather",
        "| float8 rowwise",
    ], proc.stdout
    # Each case's own build: tensorwise gathers its converted weights in float8, rowwise does not.
    assert proc.stderr.count("float8 all-gather: 42 weights gathered as float8") == 1, proc.stderr[-3000:]
    assert proc.stderr.count("(emulated): 42 of 43 linear layers") == 2, proc.stderr[-3000:]
    cases = json.loads(out.read_text())["cases"]
    assert [(c["case"], c["emulated"]) for c in cases] == [
        ("bf16", False),
        ("float8_tensorwise", True),
        ("float8_rowwise", True),
    ]
    for c in cases:
        assert c["steps"] == 2 and c["tokens_per_s"] > 0 and c["mfu_pct"] is None, c
        assert c["peak_gib"] > 0 and c["estimate_gib"] > 0 and math.isfinite(c["final_loss"]), c
    # A case refused by its config: its row says why, and the script exits with the refusal's code.
    proc = subprocess.run(
        [*args, "--cases", "float8_rowwise", "--float8.all_gather"],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "| float8 rowwise | failed (exit 2): titanlite: error: float8.all_gather needs" in proc.stdout, proc.stdout


@pytest.mark.slow
def test_nodes_with_dump_folders_of_their_own_stop_before_training(tmp_path):
    """Two launchers on this machine as two nodes (NNODES=2 NGPU=1, one c10d rendezvous), each with its own
    dump folder, as node-local disks give: every checkpoint would lack the other node's files. Both stop
    before the first step with one line naming their folder, exit code 2."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = child_env(NNODES="2", NGPU="1", RDZV_ENDPOINT=f"localhost:{port}", RDZV_ID="not-shared")
    args = [*SMALL, "--training.steps", "2", "--checkpoint.enable"]
    nodes = [
        subprocess.Popen(
            ["./run_train.sh", "--job.dump_folder", str(tmp_path / f"node{i}"), *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for i, node in enumerate(nodes):
        _, err = node.communicate(timeout=300)
        assert node.returncode == 2, err[-3000:]
        own = [line for line in err.splitlines() if not line.startswith("[rank")]
        assert own == [
            f"titanlite: error: checkpoint folder {tmp_path / f'node{i}' / 'checkpoint'} is not shared by every "
            f"rank: rank 1 (host {socket.gethostname()}) does not see the file rank 0 (host {socket.gethostname()}) "
            "wrote there; every node must write its part of a checkpoint into the same folder (a shared file "
            "system, not node-local disk)"
        ], err[-3000:]
        assert "step 1" not in err and not list((tmp_path / f"node{i}").glob("checkpoint/step-*"))


@pytest.mark.slow
def test_a_gpu_config_on_a_cpu_says_what_a_step_costs_and_goes_on(tmp_path):
    """`NGPU=1 ./run_train.sh --config train_configs/llama3_1b_gpu.toml` on a machine without CUDA: before
    any rank starts, one warning with the step's FLOPs and its time at the CPU's measured peak, and the
    launch goes on (DRY_LAUNCH: the preflight, then the launch command instead of hours of training)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the warning is for machines without CUDA")
    env = child_env(NGPU="1", DRY_LAUNCH="1")
    cmd = ["./run_train.sh", "--config", "train_configs/llama3_1b_gpu.toml", "--job.dump_folder", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert launched(proc)[-4:] == cmd[1:] and len(proc.stdout.splitlines()) == 1
    [line] = proc.stderr.splitlines()
    assert re.fullmatch(
        r"titanlite: warning: train_configs/llama3_1b_gpu\.toml is sized for a GPU: on this CPU a step is "
        r"5\.5e\+13 FLOP per process, at least \d+:\d\d:\d\d at this CPU's measured fp32 peak of [\d.]+ TFLOP/s, "
        r"\d+:\d\d:\d\d for 40 steps plus compilation; training anyway \(Ctrl-C stops\)",
        line,
    ), line
