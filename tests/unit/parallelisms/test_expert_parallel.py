"""Expert parallelism: the dispatch and combine against plain PyTorch, the experts' mesh, what is refused
before any rank starts, and runs of the Qwen3-MoE debug config through run_train.sh against one process,
with checkpoints resumed across expert-parallel degrees.

Runs: `train_configs/qwen3_moe_debug.toml` with 3 blocks, seq_len 64, global batch 4 (2 sequences per
microbatch: one process accumulates two, so every layout has the same per-microbatch auxiliary loss), 4
steps, fp32, deterministic, a checkpoint at step 2. Tolerance: the harness's relative 1e-5 on the losses.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from host_syncs import SyncCounter
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from harness import (
    LOSS_REL,
    ROOT,
    SMALL,
    RunResult,
    assert_ok,
    assert_resumed,
    child_env,
    copy_checkpoint,
    launch_workers,
    torchrun,
    train_in_one_launch,
)
from harness import max_rel as rel
from harness import step_metric as losses
from harness import train as run_trainer
from titanlite.config import ActivationCheckpoint, load_config
from titanlite.errors import ConfigError
from titanlite.models.common.moe import MoE
from titanlite.parallelisms.activation_checkpoint import apply_ac
from titanlite.parallelisms.expert_parallel.unit import apply_expert_parallel
from titanlite.parallelisms.host_replay import HostReplay
from titanlite.planning.run_plan import RunPlan

CONFIG = "train_configs/qwen3_moe_debug.toml"
STEPS, SAVE_AT = 4, 2
# Three blocks (the debug flavor's first dense, two MoE): under two pipeline stages each holds a MoE layer.
SHAPE = ["--model.n_layers", "3"]
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


@pytest.mark.parametrize("ac", ["none", "full"])
def test_one_host_sync_per_moe_layer_forward_and_none_in_the_full_ac_recompute(process_group, monkeypatch, ac):
    """Two expert-parallel MoE layers (grouped GEMM, the CUDA path) forward and backward: at most one
    host sync per layer's forward, counted as the trainer loop's are (`host_syncs.SyncCounter`), and
    under full activation checkpointing the recompute adds none; the counter counts a read it is shown."""
    torch.manual_seed(0)
    layers = nn.ModuleDict({str(i): MoE(16, 8, 4, 2, norm_topk_prob=True, grouped=True) for i in range(2)})
    replay = HostReplay()
    apply_expert_parallel(layers, init_device_mesh("cpu", (1,), mesh_dim_names=("ep",)), replay)
    checkpointed = apply_ac(dict(layers.items()), ActivationCheckpoint(mode=ac), replay)
    assert len(checkpointed) == (2 if ac == "full" else 0)
    x = torch.randn(2, 8, 16, requires_grad=True)
    with SyncCounter(monkeypatch) as counter:
        h = x
        for layer in layers.values():
            h = layer(h)
        forward = list(counter.calls)
        h.square().sum().backward()
        backward = counter.calls[len(forward) :]
        torch.zeros(()).item()  # the negative control: a read the layers do not make is counted
    monkeypatch.undo()
    assert len(forward) <= len(layers), "\n".join(forward)
    assert backward == [], "\n".join(backward)
    assert len(counter.calls) == len(forward) + 1
    assert all(p.grad is not None for p in layers.parameters())


@pytest.mark.slow
def test_dispatch_and_combine_match_plain_pytorch(tmp_path):
    """A Qwen3-MoE layer on 2 ep ranks (4 experts each): output, input gradient, router and expert
    gradients equal one process's over both ranks' tokens (fp32, 1e-5), with grouped GEMM and the loop;
    a dispatch without its backward all-to-all, and expert gradients without the 1 / ep scale, do not."""
    out = tmp_path / "diffs.json"
    assert_ok(launch_workers("tests/workers/ep_dispatch.py", [str(out)], 2))
    diffs = json.loads(out.read_text())
    for case in ("grouped", "loop"):
        assert max(diffs[case].values()) < 1e-5, diffs
    assert diffs["no_backward_dispatch"]["input_grad"] > 1e-2, diffs
    assert diffs["unscaled"]["experts.gate_up_proj.grad"] > 1e-2, diffs
    assert max(diffs["unscaled"][k] for k in ("out", "input_grad", "gate.grad")) < 1e-5, diffs


def overrides(layout: str, *extra: str, batch: int = 4) -> list[str]:
    """The command line of `layout` (global batch `batch`, `STEPS` steps, a checkpoint every `SAVE_AT`
    when enabled)."""
    steps = ["--training.steps", str(STEPS), "--training.global_batch_size", str(batch)]
    return [*SMALL, *SHAPE, *steps, "--checkpoint.interval", str(SAVE_AT), *LAYOUTS[layout][1], *extra]


# name: layout, extra arguments, global batch. Launched together by world size (`runs`).
COMPILED = ["--compile.enable", "--compile.backend", "aot_eager", "--compile.bucketing", "transformer_block"]
CKPT = ["--checkpoint.enable"]
FULL_AC = ["--activation_checkpoint.mode", "full"]
# One expert on two ranks: SimpleFSDP shards its [1, ...] weights over dp 2, so rank 1 holds no rows.
ONE_EXPERT = ["--model.num_experts", "1", "--model.top_k", "1"]
RUNS = {
    "dp4": ("dp4", [], 8),
    "ep2_efsdp2": ("ep2_efsdp2", [], 8),
    "ep2_hsdp": ("ep2_hsdp", [], 8),
    "ep2_tp2": ("ep2_tp2", CKPT, 4),
    "ep2_pp2": ("ep2_pp2", [], 8),
    "dp2": ("dp2", CKPT, 4),
    "ep2_compiled": ("ep2", COMPILED, 4),
    "ep2_accumulated": ("ep2", FULL_AC, 8),
    "dp2_accumulated": ("dp2", FULL_AC, 8),
    "pp2": ("pp2", [], 4),
    "one_expert_single": ("single", ONE_EXPERT, 4),
    "one_expert_dp2": ("dp2", ONE_EXPERT, 4),
}
# name: (the run whose step-2 checkpoint it resumes, layout).
RESUMES = {
    "ep2_on_dp2": ("ep2", "dp2"),
    "single_on_ep2": ("single", "ep2"),
    "single_on_dp2": ("single", "dp2"),
    "ep2_on_single": ("ep2", "single"),
    "ep2_tp2_on_single": ("ep2_tp2", "single"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, RunResult]:
    """Every run of the module, by name. One process and ep2 through run_train.sh, as users start them
    (each checkpointing); the other layouts and the resumes of those checkpoints (`RESUMES`) in one
    launch per world size (`harness.train_in_one_launch`), each run `titanlite.train.main` in the
    launch's processes. Two launches at a time (a launch's start-up keeps about one core busy)."""
    root = tmp_path_factory.mktemp("ep_runs")
    out: dict[str, RunResult] = {}

    def launch(world: int) -> dict[str, RunResult]:
        batch = [
            (root / n, overrides(lay, *extra, batch=b))
            for n, (lay, extra, b) in RUNS.items()
            if LAYOUTS[lay][0] == world
        ]
        for name, (src, layout) in RESUMES.items():
            if LAYOUTS[layout][0] == world:
                batch.append((copy_checkpoint(out[src].dump, root / name, SAVE_AT), overrides(layout, *CKPT)))
        return {dump.name: result for dump, result in train_in_one_launch(batch, world, CONFIG).items()}

    with ThreadPoolExecutor(2) as pool:
        four = pool.submit(launch, 4)
        for name in ("single", "ep2"):
            dump = root / name
            out[name] = run_trainer(
                dump, LAYOUTS[name][0], *overrides(name, *CKPT), config=CONFIG, launcher="run_train"
            )
            assert ("experts over ep 2 x efsdp 1" in out[name].ok().log) == (name == "ep2")
        two = pool.submit(launch, 2)
        out.update(four.result())
        out.update(launch(1))
        out.update(two.result())
    for name in RESUMES:
        assert_resumed(out[name], SAVE_AT)
    return out


def dumps(runs: dict[str, RunResult]) -> dict[str, Path]:
    return {name: r.dump for name, r in runs.items()}


@pytest.mark.slow
def test_ep2_matches_one_process_through_run_train(runs):
    """NGPU=2 ./run_train.sh --parallelism.expert_parallel_degree 2: four steps' losses equal one
    process's and dp2's (fp32, relative 1e-5), and the gradient norm (clipped by the global norm over
    the experts' and the other weights' meshes) dp2's."""
    d = dumps(runs)
    assert len(losses(d["ep2"])) == STEPS
    assert rel(losses(d["ep2"]), losses(d["single"])) <= LOSS_REL
    assert rel(losses(d["ep2"]), losses(d["dp2"])) <= LOSS_REL
    assert rel(losses(d["ep2"], "grad_norm"), losses(d["dp2"], "grad_norm")) <= LOSS_REL


@pytest.mark.slow
def test_compiled_ep2_matches_one_process(runs):
    """--compile.enable with ep2 (aot_eager: the graphs as traced, per-block bucketing): the blocks compile
    around the dispatch, which runs eager (a graph break per MoE layer), the graphs' reduce-scatters are
    bucketed, and four steps' losses equal one process's and eager ep2's (relative 1e-5)."""
    d = dumps(runs)
    report = json.loads((d["ep2_compiled"] / "compile_report.json").read_text())
    scatters = report["dp"]["reduce_scatter"]
    assert report["scope"] == "block" and scatters["after"] < scatters["before"]
    got = losses(d["ep2_compiled"])
    assert len(got) == STEPS
    assert rel(got, losses(d["single"])) <= LOSS_REL
    assert rel(got, losses(d["ep2"])) <= LOSS_REL


@pytest.mark.slow
def test_one_expert_on_two_ranks_trains_like_one_process(runs):
    """--model.num_experts 1 on 2 ranks: the expert weights [1, ...] are sharded over dp 2 and rank 1
    holds no rows of them; initialisation runs no collective that such a rank would skip (it hung in the
    init's shape read of the sharded parameter until the process group's timeout), and four steps' losses
    equal one process's (relative 1e-5)."""
    d = dumps(runs)
    got = losses(d["one_expert_dp2"])
    assert len(got) == STEPS and rel(got, losses(d["one_expert_single"])) <= LOSS_REL
    assert rel(got, losses(d["dp2"])) > LOSS_REL  # eight experts train otherwise


@pytest.mark.slow
def test_ep2_with_accumulation_and_full_ac_matches_dp2(runs):
    """ep2 with two microbatches per rank per step (the once-per-step reduction and kept gathers the
    memory estimate picks) and full AC (the recomputed forward dispatches again) gives dp2's losses."""
    d = dumps(runs)
    assert rel(losses(d["ep2_accumulated"]), losses(d["dp2_accumulated"])) <= LOSS_REL


@pytest.mark.slow
def test_pipeline_stages_match_one_process(runs):
    """pipeline_parallel_degree 2 on 2 ranks: the auxiliary loss pools both stages' MoE layers (the
    routing sums travel with the hidden states, its gradient back), and four steps' losses and gradient
    norms equal one process's (relative 1e-5)."""
    d = dumps(runs)
    assert "pipeline 1F1B: 2 stages" in runs["pp2"].log
    got = losses(d["pp2"])
    assert len(got) == STEPS and rel(got, losses(d["single"])) <= LOSS_REL
    assert rel(losses(d["pp2"], "grad_norm"), losses(d["single"], "grad_norm")) <= LOSS_REL


@pytest.mark.slow
def test_ep2_under_pipeline_stages_matches_data_parallelism(runs):
    """ep2 x pp2 on 4 ranks: each stage's experts split over the 2 ranks of its data-parallel dim, each
    rank's batch of 4 in two pipeline microbatches of 2, as dp2 accumulates them: dp2's losses and
    gradient norms (relative 1e-5)."""
    d = dumps(runs)
    log = runs["ep2_pp2"].log
    assert "experts over ep 2 x efsdp 1" in log and "pipeline 1F1B: 2 stages" in log
    assert rel(losses(d["ep2_pp2"]), losses(d["dp2_accumulated"])) <= LOSS_REL
    assert rel(losses(d["ep2_pp2"], "grad_norm"), losses(d["dp2_accumulated"], "grad_norm")) <= LOSS_REL


@pytest.mark.slow
def test_ep2_on_four_ranks_matches_data_parallelism(runs):
    """4 ranks: ep2 with the experts sharded over efsdp 2 (fully_shard), and ep2 x dp_replicate 2 (the
    experts replicated over dp_replicate, efsdp 1), give dp4's losses and gradient norms."""
    d = dumps(runs)
    assert "experts over ep 2 x efsdp 2" in runs["ep2_efsdp2"].log
    for name in ("ep2_efsdp2", "ep2_hsdp"):
        assert rel(losses(d[name]), losses(d["dp4"])) <= LOSS_REL
        assert rel(losses(d[name], "grad_norm"), losses(d["dp4"], "grad_norm")) <= LOSS_REL


@pytest.mark.slow
def test_ep2_with_tp2_on_the_dense_parts_matches_one_process_and_resumes_on_one(runs):
    """ep2 x tp2 on 4 ranks: attention and the dense layers split over tp (sequence parallel), each MoE
    layer on the gathered sequence with its experts split over ep; four steps' losses equal one process's
    (relative 1e-5), and its step-2 checkpoint resumed by one process continues them."""
    d = dumps(runs)
    assert "'tp': 2" in runs["ep2_tp2"].log and "experts over ep 2 x efsdp 1" in runs["ep2_tp2"].log
    got = losses(d["ep2_tp2"])
    assert len(got) == STEPS and rel(got, losses(d["single"])) <= LOSS_REL
    assert "resharded from world 4" in runs["ep2_tp2_on_single"].log
    assert rel(losses(d["ep2_tp2_on_single"]), {s: v for s, v in got.items() if s > SAVE_AT}) <= LOSS_REL


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2", "single"])
def test_resume_an_ep2_checkpoint_without_ep(runs, layout):
    """An ep2 checkpoint (whole [experts, ...] tensors in DCP) resumes on dp2 and on one process and
    continues the uninterrupted ep2 run: relative 1e-5 over steps 3-4 (measured: equal on dp2, 5.9e-7 on
    one process, where float rounding between 1 and 2 ranks can move a token to another expert under
    top-k routing; the uninterrupted one-process run is 4.9e-6 away, a run that was never on ep2)."""
    resumed = runs[f"ep2_on_{layout}"]
    assert "resharded from world 2, dp 2, ep 2" in resumed.log
    got = losses(resumed.dump)
    assert sorted(got) == list(range(SAVE_AT + 1, STEPS + 1))
    assert rel(got, {s: v for s, v in losses(runs["ep2"].dump).items() if s > SAVE_AT}) <= LOSS_REL


@pytest.mark.slow
def test_resume_a_one_process_checkpoint_on_ep2(runs):
    """A one-process checkpoint resumes on ep2 as on dp2 (relative 1e-5; measured: equal)."""
    assert "resharded from world 1" in runs["single_on_ep2"].log
    assert rel(losses(runs["single_on_ep2"].dump), losses(runs["single_on_dp2"].dump)) <= LOSS_REL


@pytest.mark.slow
def test_the_export_of_an_ep2_checkpoint_is_the_same_under_ep2_and_in_one_process(runs, tmp_path):
    """`titanlite.tools.hf export` of the ep2 checkpoint under torchrun with ep2 (each expert weight
    gathered whole from its ep and efsdp shards) writes the same bytes as in one process."""
    args = ["-m", "titanlite.tools.hf", "export", "--config", CONFIG, *SHAPE, "--checkpoint"]
    args += [str(runs["ep2"].dump / "checkpoint" / f"step-{SAVE_AT}"), "--out"]
    assert_ok(torchrun([*args, str(tmp_path / "ep2"), *EP2], 2))
    assert_ok(subprocess.run([sys.executable, *args, str(tmp_path / "one")], env=child_env(), cwd=ROOT))
    name = "model-00001-of-00001.safetensors"
    assert (tmp_path / "ep2" / name).read_bytes() == (tmp_path / "one" / name).read_bytes()
