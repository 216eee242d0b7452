"""Context parallelism: the head-tail sharding, attention against plain PyTorch, and runs through
run_train.sh against one process, with checkpoints resumed across cp degrees.

The layouts' parity through the trainer's step (cp2 with FSDP2, AC, accumulation, block_causal, bf16,
compile; cp2 x dp_shard2, x dp_replicate2, x tp2, pp2 x cp2 (x tp2)) and its negative control are in
tests/runs/test_parallel_parity.py. Through run_train.sh this module runs what only the command line
proves: cp2 against one process with checkpoints and validation, one composed 4-rank layout (cp2 x
dp_shard2: the loader's data-parallel ranks each shared by two cp ranks), and checkpoints resumed on the
same and on other cp degrees. The other layouts are checked in-process only: block_causal, bf16 (within
1e-3 of bf16 dp_shard2), compiled with bucketing, cp2 x tp2 and pp2 x cp2 in
tests/runs/test_parallel_parity.py.

CLI runs: the debug model cut to 2 blocks, seq_len 64, global batch 4, 4 steps, a checkpoint at step 2. Tolerances: fp32
layouts agree within the harness's relative 1e-5; a resume on its own layout is bitwise.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from harness import (
    LOSS_REL,
    ROOT,
    SHALLOW,
    SMALL,
    RunResult,
    assert_ok,
    assert_resumed,
    copy_checkpoint,
    launch_workers,
    train_in_one_launch,
)
from harness import max_rel as rel
from harness import step_metric as losses
from harness import train as run_trainer
from titanlite.config import load_config
from titanlite.parallelisms.context_parallel.unit import (
    head_tail_order,
    sequence_positions,
    shard_sequence,
    unshard_sequence,
)
from titanlite.planning.run_plan import RunPlan
from titanlite.run.replica_batches import replica_ranks

STEPS, SAVE_AT = 4, 2
CP2 = ["--parallelism.context_parallel_degree", "2"]
# Held-out documents (the same training stream for every layout), evaluated at steps 2 and 4.
HOLDOUT = ["--validation.holdout_documents", "64"]
VALIDATION = ["--validation.enable", "--validation.freq", str(SAVE_AT), "--validation.steps", "2"]
VALIDATION += ["--validation.local_batch_size", "2"]
# nproc, local batch, extra: every layout trains the same global batch of 4 sequences.
LAYOUTS = {
    "single": (1, "4", []),
    "cp2": (2, "4", CP2),
    "dp2": (2, "2", []),
    # cp composed with data parallelism (4 ranks): two loaders, each read by its two cp ranks.
    "cp2_dp_shard2": (4, "2", [*CP2, "--parallelism.data_parallel_shard_degree", "2"]),
}
# (source run, layout it resumes on): a cp2 checkpoint on cp2 (bitwise) and on dp2, a one-process
# checkpoint on cp2. A checkpoint of 2 ranks resumed by one process is tests/runs/test_checkpoint_resume.py's
# (pp2 x dp2 to one process).
RESUMES = [("cp2", "cp2"), ("cp2", "dp2"), ("single", "cp2")]


@pytest.mark.parametrize("degree", [1, 2, 4])
def test_head_tail_sharding(degree):
    """Rank r holds chunks r and 2cp-1-r; the ranks' parts in rank order unshard to the sequence; every
    rank has the same causal attention work (sum of the keys its queries see)."""
    seq = torch.arange(2 * 8 * degree).reshape(2, -1) * 10
    parts = [shard_sequence(seq, degree, r) for r in range(degree)]
    assert torch.equal(unshard_sequence(torch.cat(parts, dim=1), degree), seq)
    chunk = seq.shape[1] // (2 * degree)
    for r in range(degree):
        held = sequence_positions(seq.shape[1], degree, r)
        expected = list(range(r * chunk, (r + 1) * chunk)) + list(
            range((2 * degree - 1 - r) * chunk, (2 * degree - r) * chunk)
        )
        assert held.tolist() == expected
        assert torch.equal(parts[r], seq[:, held])
    work = {int((sequence_positions(seq.shape[1], degree, r) + 1).sum()) for r in range(degree)}
    assert len(work) == 1
    assert sorted(head_tail_order(degree)) == list(range(2 * degree))


def test_cp_sits_inside_dp_and_outside_tp_and_counts_each_token_once():
    """8 ranks as dp_shard 2 x cp 2 x tp 2: neighbours are tp peers, then cp peers; the cp ranks of a dp
    rank share its data (one loader, one replica); parameters shard over dp_shard x cp; tokens/s per GPU
    divides the global batch's tokens by the world."""
    cfg = load_config(["--config", str(ROOT / "train_configs/debug_model.toml"), *CP2, "--training.seq_len", "64"])
    cfg.parallelism.tensor_parallel_degree = 2
    plan = RunPlan.build(cfg, 8)
    dims = plan.dims
    assert dims.mesh_dim_names == ("dp_shard", "cp", "tp") and (dims.dp, dims.shard_degree) == (2, 4)
    assert [dims.dp_rank_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [dims.cp_rank_of(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert replica_ranks(dims) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert plan.global_batch == 2 * cfg.training.local_batch_size
    assert plan.tokens_per_gpu_step == plan.global_batch * 64 / 8


@pytest.mark.slow
def test_attention_and_its_gradients_match_plain_pytorch(tmp_path):
    """Llama's attention (GQA) on 2 cp ranks: output, input gradient and the weights' gradients equal
    one process's over the whole sequence (fp32); the K/V gather's backward reduce-scatter gives each
    rank the gradient every rank's queries give its keys and values. The gather overlaps the query
    projection (its matmul runs between the gather's issue and its wait) and the reduce-scatter the
    query projection's backward (both matmuls)."""
    out = tmp_path / "diffs.json"
    assert_ok(launch_workers("tests/workers/cp_attention.py", [str(out)], 2))
    result = json.loads(out.read_text())
    diffs = result["diffs"]
    assert max(diffs.values()) < 1e-5, diffs
    assert result["mms_in_flight"] == {"gather": 1, "reduce_scatter": 2}, result
    assert {"out", "input_grad", "wq.weight.grad", "wk.weight.grad", "wv.weight.grad", "wo.weight.grad"} <= set(diffs)


def overrides(layout: str, *extra: str) -> list[str]:
    steps = ["--training.steps", str(STEPS), "--training.local_batch_size", LAYOUTS[layout][1]]
    steps += ["--training.global_batch_size", "4", "--checkpoint.interval", str(SAVE_AT)]
    return [*SMALL, *SHALLOW, *steps, *HOLDOUT, *LAYOUTS[layout][2], *extra]


def train(dump: Path, layout: str, *extra: str) -> RunResult:
    return run_trainer(dump, LAYOUTS[layout][0], *overrides(layout, *extra), launcher="run_train")


def resume_name(src: str, layout: str) -> str:
    return f"{src}_to_{layout}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, RunResult]]:
    """One process and cp2 (checkpointing, validation) and cp2 x dp_shard2 through run_train.sh, two
    launches at a time (a launch keeps about one of two cores busy: its start-up is mostly one
    process's); then the resumes of `RESUMES` (each from its source's step-2 checkpoint alone, in a fresh
    dump folder), all on 2 ranks, in one launch (`harness.train_in_one_launch`)."""
    root = tmp_path_factory.mktemp("cp_runs")
    fresh = (
        ("single", ["--checkpoint.enable", *VALIDATION]),
        ("cp2", ["--checkpoint.enable", *VALIDATION]),
        ("cp2_dp_shard2", []),
    )
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = {name: pool.submit(train, root / name, name, *extra) for name, extra in fresh}
        results = {name: future.result() for name, future in done.items()}
    for result in results.values():
        assert_ok(result)
    resumes = []
    for src, layout in RESUMES:
        dst = copy_checkpoint(root / src, root / resume_name(src, layout), SAVE_AT)
        resumes.append((dst, overrides(layout, "--checkpoint.enable")))
    assert {LAYOUTS[layout][0] for _, layout in RESUMES} == {2}
    for dst, result in train_in_one_launch(resumes, 2).items():
        assert_resumed(result, SAVE_AT)
        results[dst.name] = result
    return {name: (root / name, result) for name, result in results.items()}


def dump(runs, name: str) -> Path:
    return runs[name][0]


@pytest.mark.slow
def test_cp2_matches_one_process_through_run_train(runs):
    """NGPU=2 ./run_train.sh --parallelism.context_parallel_degree 2: the losses and the held-out losses
    equal one process's (fp32, within 1e-5), and so do the logged gradient norms, also those of the dp2
    run resumed from cp2's checkpoint over the steps both trained from it."""
    cp2, single = dump(runs, "cp2"), dump(runs, "single")
    assert len(losses(cp2)) == STEPS
    assert rel(losses(cp2), losses(single)) <= LOSS_REL
    # The logged gradient norm: global over the parameters' shards, before clipping (measured equal).
    assert rel(losses(cp2, "grad_norm"), losses(single, "grad_norm")) <= LOSS_REL
    dp2 = dump(runs, resume_name("cp2", "dp2"))
    assert rel(losses(dp2, "grad_norm"), losses(cp2, "grad_norm")) <= LOSS_REL
    # Validation runs through the same sharded batch and averages over the cp ranks.
    assert sorted(losses(cp2, "val_loss")) == [SAVE_AT, STEPS]
    assert rel(losses(cp2, "val_loss"), losses(single, "val_loss")) <= LOSS_REL


@pytest.mark.slow
def test_cp2_composed_with_data_parallelism_matches_one_process_through_run_train(runs):
    """NGPU=4 cp2 x dp_shard2 (each data-parallel rank's batch split over its two cp ranks): the losses
    equal one process's (fp32, within 1e-5)."""
    assert len(losses(dump(runs, "cp2_dp_shard2"))) == STEPS
    assert rel(losses(dump(runs, "cp2_dp_shard2")), losses(dump(runs, "single"))) <= LOSS_REL


@pytest.mark.slow
@pytest.mark.parametrize("src,layout", RESUMES)
def test_resume_across_cp_degrees(runs, src, layout):
    """A cp2 checkpoint (parameters, optimizer state, data loader position) resumes on cp2 bitwise, and
    on dp2 within 1e-5 of the uninterrupted one-process run; a one-process checkpoint resumes on cp2
    likewise."""
    path, proc = runs[resume_name(src, layout)]
    got = losses(path)
    assert sorted(got) == list(range(SAVE_AT + 1, STEPS + 1))
    if src == layout:
        assert "resharded" not in proc.stderr
        assert got == {s: v for s, v in losses(dump(runs, src)).items() if s > SAVE_AT}
    else:
        assert "resharded" in proc.stderr
        assert rel(got, losses(dump(runs, "single"))) <= LOSS_REL
