"""The layout search: its memory estimate against the dry run, its step-time model's parts, the plan it
writes, and bad input.

(a) The analytic memory of a layout (`layout_memory`) equals the dry run's (`tools/dry_run`) on layouts
    that exercise each rule: TP, FSDP2 + HSDP, pure replication, reshard never/always, pipeline ranks of
    1F1B and GPipe, gradients reduced per step and per microbatch, float8 weight gathers (SimpleFSDP's
    kept for the step, FSDP2's); and on a sample of every layout a
    small search enumerates. Negative control: another reshard policy's estimate differs.
(b) The step-time model's parts: no collectives on one GPU, the schedule's bubble, prefetching hides
    collectives, the zero-bubble share only with enough microbatches, NVLink vs network.
(c) `--plan` through run_train.sh: the table with the `given` row, plan.toml, and `--dry-run` of it;
    bad input is one line with exit code 2 (unknown GPU kind, a world no layout divides) or 1 (no layout
    fits: the closest and what it needs).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import subprocess
import sys
import typing

import pytest

from harness import ROOT, child_env
from titanlite.config import GpuName, load_config
from titanlite.errors import run_cli
from titanlite.planning.assumed_vocabulary import build_run_plan
from titanlite.planning.gpus import GPU_KINDS, gpu_kind
from titanlite.planning.layout_memory import LayoutMemoryModel
from titanlite.planning.layout_search import LayoutSearch, planned_config, structure_of
from titanlite.planning.layout_space import Degrees, context_degrees
from titanlite.planning.memory import GiB
from titanlite.planning.param_shapes import ShapeTable
from titanlite.planning.step_time import Link
from titanlite.tools import layout_search, search_progress
from titanlite.tools.dry_run import dry_run, meta_model
from titanlite.tools.layout_search import toml_text

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

P = "--parallelism."
CASES = [
    pytest.param("llama3_8b.toml", [], id="8B fsdp + compile"),
    pytest.param(
        "llama3_8b.toml",
        [P + "tensor_parallel_degree", "2", P + "fsdp_reshard_after_forward", "never"],
        id="8B tp 2, reshard never",
    ),
    pytest.param(
        "llama3_8b.toml",
        [P + "dp_impl", "fsdp2", "--compile.bucketing", "none", P + "data_parallel_replicate_degree", "2"],
        id="8B fsdp2 hsdp",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        "llama3_8b.toml",
        [P + "data_parallel_replicate_degree", "8", P + "data_parallel_shard_degree", "1"],
        id="8B replicate",
    ),
    pytest.param(
        "llama3_8b.toml",
        ["--float8.enable", "--float8.all_gather", "--training.global_batch_size", "16", "--training.seq_len", "2048"],
        id="8B float8 gathers, kept for a step of 2 backwards",
    ),
    pytest.param(
        "llama3_8b.toml",
        [P + "dp_impl", "fsdp2", "--compile.bucketing", "none", "--float8.enable", "--float8.all_gather"],
        id="8B fsdp2 float8 gathers",
    ),
    pytest.param("llama3_70b_pp.toml", [], id="70B pp 1F1B per_step", marks=pytest.mark.slow),
    pytest.param("llama3_8b.toml", [P + "context_parallel_degree", "2"], id="8B cp 2"),
    pytest.param(
        "llama3_8b.toml",
        [P + "context_parallel_degree", "2", P + "tensor_parallel_degree", "2", "--training.local_batch_size", "2"],
        id="8B cp 2 x tp 2",
    ),
    pytest.param("llama3_8b_128k.toml", [], id="8B 128k cp 8 x tp 8 (cp alone shards the parameters)"),
    pytest.param(
        "llama3_8b_128k.toml",
        [P + "context_parallel_degree", "4", "--activation_checkpoint.mode", "selective"],
        id="8B 128k cp 4 x dp_shard 2 x tp 8, AC op",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        "debug_model.toml",
        ["--comm.fake_world_size", "8", P + "pipeline_parallel_degree", "2", P + "context_parallel_degree", "4"]
        + ["--training.local_batch_size", "2", P + "pipeline_parallel_microbatch_size", "1"],
        id="debug pp 2 x cp 4",
    ),
    pytest.param(
        "debug_model.toml",
        [
            "--comm.fake_world_size",
            "4",
            P + "pipeline_parallel_degree",
            "2",
            P + "pipeline_parallel_schedule",
            "GPipe",
            "--training.local_batch_size",
            "8",
            P + "pipeline_parallel_microbatch_size",
            "2",
            P + "gradient_reduction",
            "per_microbatch",
            P + "fsdp_reshard_after_forward",
            "always",
        ],
        id="debug pp GPipe per_microbatch, reshard always",
    ),
]


def analytic(cfg, world):
    plan, _ = build_run_plan(cfg, world)
    model = LayoutMemoryModel(ShapeTable(cfg, plan, meta_model))
    return model, plan, model.estimate(plan, int(cfg.comm.fake_gpu_memory_gib * GiB))


@pytest.mark.parametrize("config, overrides", CASES)
def test_analytic_memory_equals_the_dry_run(config, overrides):
    cfg = load_config(["--config", f"train_configs/{config}", *overrides])
    exact = dry_run(cfg)
    model, plan, est = analytic(cfg, exact.world_size)
    assert est.step_choice.policy == exact.step_choice.policy
    assert est.peak_total == exact.peak_total
    assert [r.total for r in est.ranks] == [r.total for r in exact.pipeline_ranks or [exact.memory]]
    assert [r.memory.total for r in est.ranks] == [r.total for r in est.ranks]  # the fast total is the estimate's
    # Negative control: the same comparison tells another layout apart.
    changed = copy.deepcopy(cfg)
    changed.activation_checkpoint.mode = "none" if cfg.activation_checkpoint.mode != "none" else "full"
    capacity = int(cfg.comm.fake_gpu_memory_gib * GiB)
    assert model.estimate(dataclasses.replace(plan, cfg=changed), capacity).peak_total != exact.peak_total


def test_searches_share_a_shape_table_only_with_the_same_float8_layers():
    """A shape table read for a run without float8 marks no float8 weight: a float8 search beside it reads
    its own (FSDP2 on 8 GPUs, the last block held and two blocks in flight, every block linear converted
    with `float8.filter_fqns output`: 3 blocks' 218,103,808 float8 elements at 1 byte, not 2)."""
    fsdp2 = ["--config", "train_configs/llama3_8b.toml", P + "dp_impl", "fsdp2", "--compile.bucketing", "none"]
    float8 = ["--float8.enable", "--float8.all_gather", "--float8.filter_fqns", "output"]
    shapes: dict = {}
    bf16 = LayoutSearch(load_config(fsdp2), 8, gpu_kind("h100"), meta_model, shapes=shapes).given()
    f8 = LayoutSearch(load_config([*fsdp2, *float8]), 8, gpu_kind("h100"), meta_model, shapes=shapes).given()
    assert not isinstance(bf16, str) and not isinstance(f8, str) and len(shapes) == 2
    assert bf16.memory.peak_total - f8.memory.peak_total == 3 * 218_103_808


@pytest.mark.parametrize(
    "impl",
    [
        pytest.param([], id="simple_fsdp"),
        pytest.param([P + "dp_impl", "fsdp2", "--compile.bucketing", "none"], id="fsdp2"),
    ],
)
def test_float8_all_gather_gathers_the_float8_weights_at_one_byte(impl):
    """8B on 8 H100s (FSDP 8, one microbatch): with `float8.all_gather` each block's gather and backward
    re-gather move its float8 weights (wq, wo and the FFN's three: 209,715,200 elements; wk and wv stay
    bf16, `auto_filter_small_kn`) at 1 byte instead of 2, every other element as before: the step's
    data-parallel collectives drop by those bytes at the shard group's per-byte rate. Negative control:
    float8 without `all_gather` moves what bf16 moves."""
    cfg = ["--config", "train_configs/llama3_8b.toml", *impl]
    shapes: dict = {}
    kind = gpu_kind("h100")
    est = {}
    for name, f8 in (
        ("bf16", []),
        ("float8", ["--float8.enable"]),
        ("gathers", ["--float8.enable", "--float8.all_gather"]),
    ):
        e = LayoutSearch(load_config([*cfg, *f8]), 8, kind, meta_model, shapes=shapes).given()
        assert not isinstance(e, str), e
        assert e.layout.degrees.dp_shard == 8 and e.layout.degrees.tp == 1 and not e.memory.layout.keep_gathers
        est[name] = e
    st = est["gathers"].memory.ranks[0].stages[0]
    regathered = sum(st.regathered[i] for i in st.block_positions)
    assert regathered == 31  # the last block's weights are held for its backward
    per_byte = Link.of(kind, 8, 1).linear(1)[0]
    saved = per_byte * 32 * 209_715_200 * (2 - 1) + per_byte * regathered * 209_715_200 * (2 - 1)
    total = {name: e.time.dp_comm_total for name, e in est.items()}
    assert total["float8"] - total["gathers"] == pytest.approx(saved, rel=1e-9)
    assert total["float8"] == total["bf16"]


@pytest.fixture(scope="module")
def debug_search():
    """Every layout of the debug model on 4 H200s: (the search, the layouts that fit, layouts tried)."""
    cfg = load_config(["--config", "train_configs/debug_model.toml", "--training.local_batch_size", "4"])
    search = LayoutSearch(cfg, 4, gpu_kind("h200"), meta_model)
    every = list(search.estimates())
    return search, [e for e in every if search.fits(e)], len(every)


def test_a_sample_of_enumerated_layouts_matches_the_dry_run(debug_search):
    search, fits, tried = debug_search
    cfg = search.cfg
    assert tried > 200 and len(fits) == tried  # the debug model fits everywhere
    degrees = {e.layout.degrees for e in fits}
    assert len(degrees) >= 8 and any(d.pp > 1 for d in degrees) and any(d.tp > 1 for d in degrees)
    for est in fits[:: len(fits) // 6]:
        out = planned_config(est.layout, cfg, 4, search.kind, search.global_batch())
        assert dry_run(out).peak_total == est.memory.peak_total, est.layout.describe()


def test_the_ranking_keeps_the_fastest_of_each_structure_and_nothing_else(debug_search):
    """`run` keeps `keep` layouts whatever the world (a search of 100,000 GPUs estimates millions): the
    fastest of each structure, in the order that ranking every layout gives, and the counts of all."""
    search, fits, tried = debug_search
    ordered = sorted(fits, key=lambda e: (e.time.step, e.memory.peak_total))  # stable: enumeration order
    structures = list(dict.fromkeys(map(structure_of, ordered)))
    fastest = [next(e for e in ordered if structure_of(e) == s) for s in structures]
    result = search.run(keep=3)
    assert (result.tried, result.fit, result.closest) == (tried, len(fits), None)
    assert [e.layout for e in result.ranked] == [e.layout for e in fastest[:3]]
    assert len(structures) > 20 and len(fits) > 200  # so that keeping 3 leaves most out
    # Negative control: a ranking by memory alone would differ.
    assert [e.layout for e in fastest[:3]] != [e.layout for e in sorted(fits, key=lambda e: e.gib)[:3]]


def test_a_long_search_says_how_far_it_is(capsys, tmp_path, monkeypatch):
    """A line on stderr every 30 s of search (none in a short one): the clock here jumps 31 s after the
    start, so exactly one line comes, at the first layout; the table on stdout is the same either way.
    A row's reason gives the gap and its parts in a unit that shows them: the debug model's step takes
    milliseconds, which read "+0.00 s"."""
    args = ["--config", "train_configs/debug_model.toml", "--comm.fake_world_size", "2", "--layout_search.gpu", "h200"]
    rc, quiet, err = run_plan(capsys, *args, "--job.dump_folder", str(tmp_path / "a"))
    assert (rc, err) == (0, "")
    assert [line for line in quiet.splitlines() if line.startswith("  given: ")] == [
        "  given: 119.5% slower per step (+1.5 ms): exposed dp collectives +1.5 ms, optimizer -0.024 ms"
    ]
    times = iter([0.0])
    monkeypatch.setattr(search_progress, "clock", lambda: next(times, 31.0))
    rc, out, err = run_plan(capsys, *args, "--job.dump_folder", str(tmp_path / "b"))
    assert rc == 0 and err.splitlines() == [
        "layout search: mesh 1 of 5 (tp 2) after 31 s; layouts so far: 1 estimated, 0 fit"
    ]
    assert len(out.splitlines()) == len(quiet.splitlines()) == 20


def test_the_search_offers_only_layouts_the_run_plan_accepts():
    """Compiled as one graph, full AC needs SimpleFSDP's passes (data parallelism) and a split-backward
    schedule cannot run compiled blocks: the search leaves out what the launch would refuse."""
    compiled = ["--compile.enable", "--compile.scope", "model", "--compile.backend", "aot_eager"]
    cfg = load_config(["--config", "train_configs/debug_model.toml", "--training.local_batch_size", "2", *compiled])
    search = LayoutSearch(cfg, 2, gpu_kind("h200"), meta_model)
    fits = [e for e in search.estimates() if search.fits(e)]
    full = {e.layout.degrees for e in fits if e.layout.ac in ("full", "every 2")}  # blocks under full AC
    assert Degrees(dp_shard=2) in full and all(d.dp > 1 for d in full)
    tp = {e.layout.ac for e in fits if e.layout.degrees == Degrees(tp=2)}
    assert tp == {"none", "op", "op_all_mm"}  # the AC choices without fully checkpointed blocks remain
    schedules = {e.layout.schedule for e in fits if e.layout.degrees.pp > 1}
    assert "Interleaved1F1B" in schedules and "InterleavedZeroBubble" not in schedules


@pytest.mark.slow
def test_the_search_plans_context_parallelism_where_the_model_allows():
    """131,072-token sequences on 64 GPUs, one sequence per step: only cp (x tp x pp) splits the world.
    cp keeps 4096 tokens a rank (cp <= 32), never shares a factor with the microbatch (a data-parallel
    layout would do the same without the K/V gathers), and a family without the seam gets none."""
    cfg = load_config(["--config", "train_configs/llama3_8b_128k.toml"])
    search = LayoutSearch(cfg, 64, gpu_kind("h100"), meta_model)
    fits = [e for e in search.estimates() if search.fits(e)]
    assert {e.layout.degrees.cp for e in fits} == {2, 4, 8, 16, 32}
    assert all(math.gcd(e.layout.degrees.cp, e.layout.microbatch) == 1 for e in fits)
    assert context_degrees(cfg, 64) == {1, 2, 4, 8, 16, 32}
    moe = load_config(["--config", "train_configs/qwen3_moe_debug.toml", "--training.seq_len", "8192"])
    assert context_degrees(moe, 64) == {1}


def step_of(config: str, world: int, *overrides: str, kind: str = "h100"):
    cfg = load_config(["--config", f"train_configs/{config}", *overrides])
    est = LayoutSearch(cfg, world, gpu_kind(kind), meta_model).given()
    assert not isinstance(est, str), est
    return est.time


@pytest.mark.slow
def test_step_time_parts():
    one = step_of("llama3_8b.toml", 1, "--model.n_layers", "2")
    assert one.exposed_comm == 0 and one.bubble == 0 and one.step > one.compute > 0
    # Same layout, FSDP2 (prefetches) against SimpleFSDP eager (each collective next to its compute).
    eager = step_of("llama3_8b.toml", 8, "--no-compile.enable")
    fsdp2 = step_of("llama3_8b.toml", 8, "--no-compile.enable", P + "dp_impl", "fsdp2", "--compile.bucketing", "none")
    assert eager.dp_comm_total == pytest.approx(fsdp2.dp_comm_total, rel=0.2)
    assert fsdp2.dp_comm < 0.2 * eager.dp_comm
    # The pipeline's bubble is the schedule's; zero bubble takes a share only with >= pp microbatches.
    pp = ["--comm.fake_world_size", "64"]
    f1b = step_of("llama3_70b_pp.toml", 64, *pp)
    assert f1b.bubble_fraction == pytest.approx(3 / (32 + 3))
    zb = [
        P + "pipeline_parallel_schedule",
        "InterleavedZeroBubble",
        P + "gradient_reduction",
        "auto",
        "--no-compile.enable",
    ]
    assert step_of("llama3_70b_pp.toml", 64, *zb).bubble_fraction == pytest.approx(3 / (2 * 32 + 3) / 3)
    few = [*zb, "--training.local_batch_size", "2", "--training.global_batch_size", "4"]
    # 2 microbatches on 4 ranks of 2 stages each: each crosses all 8 stages in turn, a step spans 8 + 1.
    assert step_of("llama3_70b_pp.toml", 64, *few).bubble_fraction == pytest.approx(1 - 2 * 2 / (2 * 4 + 1))
    # A group across nodes runs at the network's per-GPU bandwidth times its members per node.
    kind = gpu_kind("h100")
    assert Link.of(kind, 8, 1).bytes_per_s > Link.of(kind, 16, 8).bytes_per_s == Link(kind, 16, 1).bytes_per_s
    assert Link.of(kind, 64, 1).bytes_per_s == pytest.approx(8 * kind.network_gbps * 1e9 * 0.8)  # 8 NICs < NVLink
    # Context parallelism: cp 2 with two sequences a rank computes what dp_shard 8 with one does, over the
    # same shard group, plus the K/V collectives; its cp ranks are neighbours (NVLink), while cp 8 x tp 8
    # spreads them over eight nodes (the network).
    batch = ["--training.global_batch_size", "8", "--no-compile.enable"]
    dp8 = step_of("llama3_8b.toml", 8, *batch, "--training.local_batch_size", "1")
    cp2 = step_of("llama3_8b.toml", 8, *batch, "--training.local_batch_size", "2", P + "context_parallel_degree", "2")
    assert dp8.comm.get("context", 0.0) == 0 < cp2.comm["context"] < 0.1 * cp2.step
    assert cp2.compute == pytest.approx(dp8.compute) and cp2.dp_comm_total == pytest.approx(dp8.dp_comm_total)
    assert cp2.step == pytest.approx(dp8.step + cp2.comm["context"])
    assert Link.of(kind, 8, 8).bytes_per_s < Link.of(kind, 2, 1).bytes_per_s


def test_a_planned_layout_is_a_config_that_loads_back(tmp_path, debug_search):
    search, fits, _ = debug_search
    cfg = search.cfg
    best = next(e for e in fits if e.layout.degrees.pp > 1 and e.layout.degrees.tp > 1)  # every section's keys
    out = planned_config(best.layout, cfg, 4, search.kind, search.global_batch())
    path = tmp_path / "plan.toml"
    path.write_text(toml_text(out, "a header\nof two lines"))
    tomllib.loads(path.read_text())
    back = load_config(["--config", str(path)])
    for key, value in best.layout.overrides().items():
        section, name = key.split(".")
        assert getattr(getattr(back, section), name) == value, key
    assert back.training.global_batch_size == search.global_batch() == 16
    assert back.comm.fake_world_size == 4 and back.comm.fake_gpu_memory_gib == GPU_KINDS["h200"].memory_gib
    assert back.optimizer.lr == cfg.optimizer.lr and back.model.flavor == "debugmodel"


def test_every_plannable_gpu_kind_has_figures():
    assert list(GPU_KINDS) == list(typing.get_args(GpuName))
    assert all(gpu_kind(name).training_efficiency > 0 for name in GPU_KINDS)


def run_plan(capsys, *argv):
    rc = run_cli(layout_search.main, list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err.strip()


def test_bad_input_is_one_line(capsys, tmp_path):
    dump = ["--job.dump_folder", str(tmp_path)]
    rc, _, err = run_plan(capsys, "--config", "train_configs/llama3_8b.toml", "--layout_search.gpu", "x100", *dump)
    assert rc == 2 and err == (
        "titanlite: error: config key 'layout_search.gpu' = 'x100': "
        "expected one of h100, h100-96gb-500w, h200, a100, b200"
    )
    world7 = ["--comm.fake_world_size", "7", "--training.global_batch_size", "8"]
    rc, _, err = run_plan(capsys, "--config", "train_configs/llama3_8b.toml", *world7, *dump)
    assert rc == 2 and err.startswith("titanlite: error: no valid layout of 8B on 7 GPUs") and "\n" not in err
    # 8B's weights, gradients and AdamW state alone are 120 GiB: no layout of one GPU holds them.
    rc, out, err = run_plan(capsys, "--config", "train_configs/llama3_8b.toml", "--comm.fake_world_size", "1", *dump)
    assert rc == 1 and not out and "\n" not in err
    assert err.startswith("titanlite: error: no layout fits 1 x h100: closest one rank, AC full, ")
    assert float(err.split(" needs ")[1].split()[0]) > 120 and " GiB per GPU of 79.1" in err
    assert not any(tmp_path.iterdir())
    # A family without a step-time model: the line names what it lacks and what plans it instead.
    rc, out, err = run_plan(capsys, "--config", "train_configs/qwen3_moe_debug.toml", *dump)
    assert (rc, out) == (2, "") and err == (
        "titanlite: error: model 'qwen3_moe' has no step-time model (ModelSpec): --plan cannot rank its layouts; "
        "--dry-run plans the memory of the layout you give"
    )


def test_a_dump_folder_that_cannot_hold_the_plan_is_one_line_before_the_search(capsys, tmp_path):
    """plan.toml goes to the dump folder: a file in its place is refused before the search runs (after it,
    the search's minutes were lost to a traceback); a folder that takes files plans (the control)."""
    (tmp_path / "a_file").write_text("")
    rc, out, err = run_plan(capsys, "--job.dump_folder", str(tmp_path / "a_file"))
    assert (rc, out) == (
        2,
        "",
    ) and err == f"titanlite: error: job.dump_folder '{tmp_path / 'a_file'}' is a file, not a folder"
    rc, out, err = run_plan(capsys, "--job.dump_folder", str(tmp_path / "plans"))
    assert rc == 0 and (tmp_path / "plans" / "plan.toml").is_file(), err


@pytest.mark.slow
def test_plan_through_run_train_sh_writes_a_config_the_dry_run_accepts(tmp_path):
    def sh(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["./run_train.sh", *args], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300
        )

    proc = sh("--config", "train_configs/llama3_8b.toml", "--plan", "--job.dump_folder", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("layout search: llama3 8B on 8 x h100")
    header = next(i for i, line in enumerate(lines) if line.startswith("#"))
    assert lines[header + 1].startswith("given  dp_shard 8, AC op, batch 1, reshard auto")
    assert lines[header + 2].startswith("1 ") and any(line.startswith("  given: ") for line in lines)
    plan = tmp_path / "plan.toml"
    assert f"wrote {plan}" in proc.stdout
    check = sh("--config", str(plan), "--dry-run")
    assert check.returncode == 0, check.stderr
    assert check.stdout.strip().splitlines()[-1].startswith("fits: ")
    bad = sh("--config", "train_configs/llama3_8b.toml", "--plan", "--layout_search.gpu", "x100")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "layout_search.gpu" in bad.stderr
    full = sh("--config", "train_configs/llama3_8b.toml", "--plan", "--comm.fake_world_size", "1")
    assert full.returncode == 1 and not full.stdout and full.stderr.strip().count("\n") == 0
    assert full.stderr.startswith("titanlite: error: no layout fits 1 x h100: closest ")


@pytest.mark.slow  # two searches of 8B on 8 GPUs, 12 s
def test_plan_honours_the_gpu_memory_given(capsys, tmp_path):
    """`comm.fake_gpu_memory_gib` on the command line (or in the config) replaces the GPU kind's memory
    (whose own value `planned_config` writes otherwise, above): the search ranks against it, the dry run
    confirms against it and plan.toml keeps it. 8B on 8 GPUs: the given layout needs about 49 GiB, so at
    40 GiB it does not fit and the best layout holds at most 90% of 40; at 0.5 GiB nothing fits."""
    base = ["--config", "train_configs/llama3_8b.toml", "--comm.fake_world_size", "8"]
    rc, out, _ = run_plan(capsys, *base, "--comm.fake_gpu_memory_gib", "40", "--job.dump_folder", str(tmp_path))
    assert rc == 0 and "8 x h100 (" in out and ", 40 GiB), seq 8192" in out
    assert next(line for line in out.splitlines() if line.startswith("  given: ")).endswith("; does not fit")
    written = load_config(["--config", str(tmp_path / "plan.toml")])
    assert written.comm.fake_gpu_memory_gib == 40
    assert dry_run(written).peak_total <= 0.9 * 40 * GiB
    rc, out, err = run_plan(capsys, *base, "--comm.fake_gpu_memory_gib=0.5", "--job.dump_folder", str(tmp_path / "x"))
    assert rc == 1 and not out and err.startswith("titanlite: error: no layout fits 8 x h100: closest ")
    assert " GiB per GPU of 0.5 (within 90%: 0.5)" in err


@pytest.mark.slow
def test_a_float8_run_is_planned_at_the_gpus_float8_matmul_rate():
    """`float8.enable` makes the step-time model count the blocks' matmuls at the GPU's float8 rate;
    emulated float8 (the negative control) computes at the training dtype's, as the run does."""
    layers = ("--model.n_layers", "2")
    bf16 = step_of("llama3_8b.toml", 8, *layers)
    float8 = step_of("llama3_8b.toml", 8, *layers, "--float8.enable")
    emulated = step_of("llama3_8b.toml", 8, *layers, "--float8.enable", "--float8.emulate")
    assert float8.compute < 0.9 * bf16.compute and float8.step < bf16.step  # 0.85x: the output stays bf16
    assert emulated.compute == bf16.compute
