"""Expert parallelism: the dispatch and combine against plain PyTorch, the experts' mesh, what is refused
before any rank starts, and runs of the Qwen3-MoE debug config through run_train.sh against one process,
with checkpoints resumed across expert-parallel degrees.

CLI runs: `train_configs/qwen3_moe_debug.toml`, seq_len 64, global batch 4 (2 sequences per microbatch:
one process accumulates two, so every layout has the same per-microbatch auxiliary loss), 6 steps, fp32,
deterministic, a checkpoint at step 3. Tolerance: the harness's relative 1e-5 on the losses.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness import LOSS_REL, ROOT, SMALL, RunResult, assert_ok, child_env, resume_from, torchrun
from harness import max_rel as rel
from harness import step_metric as losses
from harness import train as run_trainer
from titanlite.config import load_config
from titanlite.errors import ConfigError
from titanlite.plan import RunPlan

CONFIG = "train_configs/qwen3_moe_debug.toml"
STEPS, SAVE_AT = 6, 3
EP2 = ["--parallelism.expert_parallel_degree", "2"]
# Two stages (1F1B), each rank's local batch of 4 in two pipeline microbatches of 2: the microbatches one
# process accumulates.
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]
PP2 += ["--training.local_batch_size", "4"]
# nproc, extra: every layout trains the same global batch of 4 sequences in microbatches of 2.
LAYOUTS = {
    "single": (1, []),
    "dp2": (2, []),
    "ep2": (2, EP2),
    "dp4": (4, []),
    "ep2_efsdp2": (4, EP2),
    "ep2_hsdp": (4, [*EP2, "--parallelism.data_parallel_replicate_degree", "2"]),
    "ep2_tp2": (4, [*EP2, "--parallelism.tensor_parallel_degree", "2"]),
    "pp2": (2, PP2),
    "ep2_pp2": (4, [*EP2, *PP2]),
}


def plan(world: int, *extra: str) -> RunPlan:
    return RunPlan.build(load_config(["--config", str(ROOT / CONFIG), *extra]), world)


def test_ep_borrows_the_shard_ranks_and_splits_them_into_efsdp_and_ep():
    """dp_shard 4 with ep 2: the experts are sharded over ep (neighbouring ranks) and data-parallel over
    efsdp (2 ranks); with dp_replicate 2 they are hybrid-sharded over (dp_replicate, efsdp)."""
    dims = plan(4, *EP2).dims
    assert (dims.ep, dims.efsdp, dims.shard_degree, dims.expert_dp_mode) == (2, 2, 4, "fully_shard")
    dims = plan(8, *EP2, "--parallelism.data_parallel_replicate_degree", "2").dims
    assert (dims.ep, dims.efsdp, dims.expert_dp_mode, dims.expert_param_ndim) == (2, 2, "hybrid_shard", 2)


@pytest.mark.parametrize(
    ("world", "keys", "error"),
    [
        (2, ["--parallelism.expert_parallel_degree", "3"], "must divide data_parallel_shard_degree 2"),
        (6, ["--parallelism.expert_parallel_degree", "3"], "does not divide the model's 8 experts"),
        (2, [*EP2, "--parallelism.dp_impl", "fsdp2"], "needs dp_impl simple_fsdp"),
        (2, [*EP2, "--compile.enable", "--compile.scope", "model"], "compile.scope=model with expert_parallel"),
        (2, [*EP2, "--model.name", "llama3", "--model.flavor", "debugmodel"], "no experts to split"),
    ],
)
def test_what_expert_parallelism_does_not_support_is_refused_before_any_rank_starts(world, keys, error):
    with pytest.raises(ConfigError, match=error):
        plan(world, *keys)


@pytest.mark.slow
def test_dispatch_and_combine_match_plain_pytorch(tmp_path):
    """A Qwen3-MoE layer on 2 ep ranks (4 experts each): output, input gradient, router and expert
    gradients equal one process's over both ranks' tokens (fp32, 1e-5), with grouped GEMM and the loop;
    a dispatch without its backward all-to-all, and expert gradients without the 1 / ep scale, do not."""
    out = tmp_path / "diffs.json"
    assert_ok(torchrun(["tests/workers/ep_dispatch.py", str(out)], 2))
    diffs = json.loads(out.read_text())
    for case in ("grouped", "loop"):
        assert max(diffs[case].values()) < 1e-5, diffs
    assert diffs["no_backward_dispatch"]["input_grad"] > 1e-2, diffs
    assert diffs["unscaled"]["experts.gate_up_proj.grad"] > 1e-2, diffs
    assert max(diffs["unscaled"][k] for k in ("out", "input_grad", "gate.grad")) < 1e-5, diffs


def train(dump: Path, layout: str, *extra: str, batch: int = 4) -> RunResult:
    nproc, layout_args = LAYOUTS[layout]
    return run_trainer(
        dump,
        nproc,
        *SMALL,
        "--training.steps",
        str(STEPS),
        "--training.global_batch_size",
        str(batch),
        "--checkpoint.interval",
        str(SAVE_AT),
        *layout_args,
        *extra,
        config=CONFIG,
        launcher="run_train",
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """One process, ep2 and dp2, each checkpointing; one after another."""
    root = tmp_path_factory.mktemp("ep_runs")
    out = {}
    for name in ("single", "ep2", "dp2"):
        proc = train(root / name, name, "--checkpoint.enable")
        assert_ok(proc)
        assert ("experts over ep 2 x efsdp 1" in proc.log) == (name == "ep2")
        out[name] = root / name
    return out


@pytest.mark.slow
def test_ep2_matches_one_process_through_run_train(runs):
    """NGPU=2 ./run_train.sh --parallelism.expert_parallel_degree 2: six steps' losses equal one
    process's and dp2's (fp32, relative 1e-5), and the gradient norm (clipped by the global norm over
    the experts' and the other weights' meshes) dp2's."""
    assert len(losses(runs["ep2"])) == STEPS
    assert rel(losses(runs["ep2"]), losses(runs["single"])) <= LOSS_REL
    assert rel(losses(runs["ep2"]), losses(runs["dp2"])) <= LOSS_REL
    assert rel(losses(runs["ep2"], "grad_norm"), losses(runs["dp2"], "grad_norm")) <= LOSS_REL


@pytest.mark.slow
def test_compiled_ep2_matches_one_process(runs, tmp_path):
    """--compile.enable with ep2 (aot_eager: the graphs as traced, per-block bucketing): the blocks compile
    around the dispatch, which runs eager (a graph break per MoE layer), the graphs' reduce-scatters are
    bucketed, and six steps' losses equal one process's and eager ep2's (relative 1e-5)."""
    compiled = ["--compile.enable", "--compile.backend", "aot_eager", "--compile.bucketing", "transformer_block"]
    assert_ok(train(tmp_path / "compiled", "ep2", *compiled))
    report = json.loads((tmp_path / "compiled" / "compile_report.json").read_text())
    scatters = report["dp"]["reduce_scatter"]
    assert report["scope"] == "block" and scatters["after"] < scatters["before"]
    got = losses(tmp_path / "compiled")
    assert len(got) == STEPS
    assert rel(got, losses(runs["single"])) <= LOSS_REL
    assert rel(got, losses(runs["ep2"])) <= LOSS_REL


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory) -> dict[str, Path]:
    """ep2 and dp2 at global batch 8: two microbatches of 2 per rank and step, with full AC."""
    root = tmp_path_factory.mktemp("ep_accumulated")
    for name in ("ep2", "dp2"):
        assert_ok(train(root / name, name, "--activation_checkpoint.mode", "full", batch=8))
    return {name: root / name for name in ("ep2", "dp2")}


@pytest.mark.slow
def test_ep2_with_accumulation_and_full_ac_matches_dp2(accumulated):
    """ep2 with two microbatches per rank per step (the once-per-step reduction and kept gathers the
    memory plan picks) and full AC (the recomputed forward dispatches again) gives dp2's losses."""
    assert rel(losses(accumulated["ep2"]), losses(accumulated["dp2"])) <= LOSS_REL


@pytest.mark.slow
def test_pipeline_stages_match_one_process(runs, tmp_path):
    """NGPU=2 with pipeline_parallel_degree 2: the auxiliary loss pools both stages' MoE layers (the
    routing sums travel with the hidden states, its gradient back), and six steps' losses and gradient
    norms equal one process's (relative 1e-5)."""
    proc = train(tmp_path / "pp2", "pp2")
    assert_ok(proc)
    assert "pipeline 1F1B: 2 stages" in proc.log
    got = losses(tmp_path / "pp2")
    assert len(got) == STEPS and rel(got, losses(runs["single"])) <= LOSS_REL
    assert rel(losses(tmp_path / "pp2", "grad_norm"), losses(runs["single"], "grad_norm")) <= LOSS_REL


@pytest.mark.slow
def test_ep2_under_pipeline_stages_matches_data_parallelism(accumulated, tmp_path):
    """NGPU=4, ep2 x pp2: each stage's experts split over the 2 ranks of its data-parallel dim, each rank's
    batch of 4 in two pipeline microbatches of 2, as dp2 accumulates them: dp2's losses and gradient
    norms (relative 1e-5)."""
    proc = train(tmp_path / "ep2_pp2", "ep2_pp2", batch=8)
    assert_ok(proc)
    assert "experts over ep 2 x efsdp 1" in proc.log and "pipeline 1F1B: 2 stages" in proc.log
    assert rel(losses(tmp_path / "ep2_pp2"), losses(accumulated["dp2"])) <= LOSS_REL
    assert rel(losses(tmp_path / "ep2_pp2", "grad_norm"), losses(accumulated["dp2"], "grad_norm")) <= LOSS_REL


@pytest.mark.slow
def test_ep2_on_four_ranks_matches_data_parallelism(tmp_path):
    """NGPU=4: ep2 with the experts sharded over efsdp 2 (fully_shard), and ep2 x dp_replicate 2 (the
    experts replicated over dp_replicate, efsdp 1), give dp4's losses and gradient norms."""
    for name in ("dp4", "ep2_efsdp2", "ep2_hsdp"):
        assert_ok(train(tmp_path / name, name, batch=8))
    for name in ("ep2_efsdp2", "ep2_hsdp"):
        assert rel(losses(tmp_path / name), losses(tmp_path / "dp4")) <= LOSS_REL
        assert rel(losses(tmp_path / name, "grad_norm"), losses(tmp_path / "dp4", "grad_norm")) <= LOSS_REL


@pytest.mark.slow
def test_ep2_with_tp2_on_the_dense_parts_matches_one_process_and_resumes_on_one(runs, tmp_path):
    """NGPU=4 ep2 x tp2: attention and the dense layers split over tp (sequence parallel), each MoE layer
    on the gathered sequence with its experts split over ep; six steps' losses equal one process's
    (relative 1e-5), and its step-3 checkpoint resumed by one process continues them."""
    proc = train(tmp_path / "ep2_tp2", "ep2_tp2", "--checkpoint.enable")
    assert_ok(proc)
    assert "'tp': 2" in proc.log and "experts over ep 2 x efsdp 1" in proc.log
    got = losses(tmp_path / "ep2_tp2")
    assert len(got) == STEPS and rel(got, losses(runs["single"])) <= LOSS_REL
    resumed = resume(tmp_path / "ep2_tp2", tmp_path / "single", "single")
    assert "resharded from world 4" in resumed.stderr
    assert rel(losses(tmp_path / "single"), {s: v for s, v in got.items() if s > SAVE_AT}) <= LOSS_REL


def resume(src: Path, dst: Path, layout: str) -> RunResult:
    """Train `layout` from `src`'s step-3 checkpoint alone (a fresh dump folder)."""
    return resume_from(src, dst, SAVE_AT, lambda dump: train(dump, layout, "--checkpoint.enable"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2", "single"])
def test_resume_an_ep2_checkpoint_without_ep(runs, tmp_path, layout):
    """An ep2 checkpoint (whole [experts, ...] tensors in DCP) resumes on dp2 and on one process and
    continues the uninterrupted ep2 run: relative 1e-5 over steps 4-6 (measured: equal on dp2, 6.1e-6 on
    one process, where float rounding between 1 and 2 ranks can move a token to another expert under
    top-k routing; the uninterrupted one-process run is 1.3e-5 away, a run that was never on ep2)."""
    proc = resume(runs["ep2"], tmp_path / "ep2", layout)
    assert "resharded from world 2, dp 2, ep 2" in proc.stderr
    got = losses(tmp_path / "ep2")
    assert sorted(got) == list(range(SAVE_AT + 1, STEPS + 1))
    assert rel(got, {s: v for s, v in losses(runs["ep2"]).items() if s > SAVE_AT}) <= LOSS_REL


@pytest.mark.slow
def test_resume_a_one_process_checkpoint_on_ep2(runs, tmp_path):
    """A one-process checkpoint resumes on ep2 as on dp2 (relative 1e-5; measured: equal)."""
    ep2 = resume(runs["single"], tmp_path / "ep2", "ep2")
    assert "resharded from world 1" in ep2.stderr
    resume(runs["single"], tmp_path / "dp2", "dp2")
    assert rel(losses(tmp_path / "ep2"), losses(tmp_path / "dp2")) <= LOSS_REL


@pytest.mark.slow
def test_the_export_of_an_ep2_checkpoint_is_the_same_under_ep2_and_in_one_process(runs, tmp_path):
    """`titanlite.tools.hf export` of the ep2 checkpoint under torchrun with ep2 (each expert weight
    gathered whole from its ep and efsdp shards) writes the same bytes as in one process."""
    args = ["-m", "titanlite.tools.hf", "export", "--config", CONFIG, "--checkpoint"]
    args += [str(runs["ep2"] / "checkpoint" / f"step-{SAVE_AT}"), "--out"]
    assert_ok(torchrun([*args, str(tmp_path / "ep2"), *EP2], 2))
    assert_ok(subprocess.run([sys.executable, *args, str(tmp_path / "one")], env=child_env(), cwd=ROOT))
    name = "model-00001-of-00001.safetensors"
    assert (tmp_path / "ep2" / name).read_bytes() == (tmp_path / "one" / name).read_bytes()
