"""torch.compile with SimpleFSDP: graph passes, the collective report, and numerical parity.

Structure (one process, torch's fake process group, aot_eager): the report's per-step collective counts
for a 3-block model under each bucketing mode and scope. Parity (2 gloo ranks): compiled runs under
every bucketing mode, both backends, 1D and dp x tp and every AC mode match one process within the
parity harness's tolerances (loss 1e-5 relative over 4 steps, gradients 1e-6, parameters 1e-4 after one
AdamW step; bucketing only concatenates buffers, so it is exact, and inductor's fused fp32 kernels stay
within the same bounds). bf16 parameters with fp32 reduction, compiled and bucketed, match eager
SimpleFSDP in bf16 within 1e-3 relative loss over the 4 steps (auto and transformer_block bucketing).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from builders import config
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._ordered_set import OrderedSet

from harness import LOSS_REL, SMALL, Case, as_case, check_parity, parity, tiny_args, train
from titanlite import torch_support
from titanlite.compile.collectives import graph_collectives
from titanlite.compile.compiler import apply_compile
from titanlite.compile.passes import BLOCK_BUCKET, BucketingPass, CostModel, RecomputeTagPass, module_fqn
from titanlite.config import JobConfig
from titanlite.errors import ConfigError
from titanlite.models.llama3 import Transformer
from titanlite.models.llama3.parallelize import llama_units
from titanlite.parallelisms import parallelize
from titanlite.parallelisms.activation_checkpoint import apply_ac
from titanlite.parallelisms.data_parallel.reshard import ReshardPolicy
from titanlite.parallelisms.float8 import unit as float8
from titanlite.parallelisms.parallel_dims import ParallelDims
from titanlite.parallelisms.parallelism import ParallelismUnit
from titanlite.tools.dry_run import compile_report

N = 3
ARGS = tiny_args(n_layers=N)
PER_BLOCK = 9  # wq wk wv wo w1 w2 w3 + two norms
ROOT = 3  # tok_embeddings, norm, output


def compiled(tmp_path, bucketing: str, scope: str = "block", **over) -> JobConfig:
    """Compiled with aot_eager, `bucketing` and `scope`."""
    return config(
        tmp_path,
        compile__enable=True,
        compile__backend="aot_eager",
        compile__bucketing=bucketing,
        compile__scope=scope,
        **over,
    )


@pytest.fixture(autouse=True)
def inductor_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))


# --- structure on the fake process group ------------------------------------------------------------------


@pytest.mark.slow  # compiles (seconds each): the fast tier keeps the auto-bucketing structure test
@pytest.mark.parametrize("scope", ["block", "model"])
def test_transformer_block_bucketing_gives_one_bucket_per_block(tmp_path, scope):
    report = compile_report(compiled(tmp_path, "transformer_block", scope), 2, ARGS)
    dp = report["dp"]
    assert (tmp_path / "compile_report.json").exists()
    if scope == "model":  # buckets: [tok_embeddings], each block, [norm, output]
        assert dp["all_gather"] == {"before": N * PER_BLOCK + ROOT, "after": N + 2}
        assert dp["reduce_scatter"] == {"before": N * PER_BLOCK + ROOT, "after": N + 2}
        assert report["eager_params"] == 0
    else:  # one bucket per compiled block; the root's three parameters stay eager
        assert dp["all_gather"] == {"before": N * PER_BLOCK, "after": N}
        assert dp["reduce_scatter"] == {"before": N * PER_BLOCK, "after": N}
        assert report["eager_params"] == ROOT
    # reshard "default": every block but the last is gathered again in backward, one bucket each.
    assert dp["backward_all_gather"] == {"before": (N - 1) * PER_BLOCK, "after": N - 1}
    assert report["n_blocks"] == N and report["compile_seconds"] > 0


@pytest.mark.parametrize(
    "ac,scope",
    [
        ("full", "model"),
        pytest.param("none", "model", marks=pytest.mark.slow),
        pytest.param("full", "block", marks=pytest.mark.slow),
    ],
)
def test_next_blocks_gather_overlaps_this_blocks_compute(tmp_path, monkeypatch, ac, scope):
    """N blocks, transformer_block bucketing. In one graph (scope model), under every AC mode:
    forward prefetches the gathers of blocks 1..N-1 and of [norm, output] during the previous unit's
    compute (block 0's only follows the embedding, which has no matmul); backward prefetches the
    re-gathers of blocks N-2..0 and leaves the reduce-scatters of [norm, output] and blocks N-1..1 in
    flight over the next unit's backward (with the debug model's 6 blocks: 11 and 6). Full checkpointing
    recomputes every block in backward: besides each projection's two gradient matmuls, each block's
    matmuls run again (all but w2's, whose output only the residual add reads). Per-block
    graphs (the control) overlap nothing."""
    from titanlite.compile import partitioner

    backward_mm = []
    original = partitioner.min_cut_rematerialization_partition

    def partition(*args, **kwargs):
        fw, bw = original(*args, **kwargs)
        backward_mm.append(len(bw.graph.find_nodes(op="call_function", target=torch.ops.aten.mm.default)))
        return fw, bw

    monkeypatch.setattr(partitioner, "min_cut_rematerialization_partition", partition)
    cfg = compiled(tmp_path, "transformer_block", scope, activation_checkpoint__mode=ac)
    report = compile_report(cfg, 2, ARGS)
    if scope == "block":
        assert report["scope"] == "block"
        assert report["prefetched_all_gathers"] == report["overlapped_reduce_scatters"] == 0
        return
    assert report["scope"] == "model" and report["dp"]["backward_all_gather"]["after"] == N - 1
    # torch 2.11 and 2.12 keep one reduce-scatter fewer in flight (measured: N - 1; 2.13 and 2.15: N).
    overlapped = N if torch_support.release(torch.__version__) >= (2, 13) else N - 1
    assert report["prefetched_all_gathers"] == N + (N - 1) and report["overlapped_reduce_scatters"] == overlapped
    projections = N * 7 + 1  # each block's seven, and the output
    assert backward_mm == [2 * projections + (N * 6 if ac == "full" else 0)]


@pytest.mark.parametrize("reshard,traces", [("always", 1), pytest.param("default", 2, marks=pytest.mark.slow)])
def test_identical_blocks_share_one_trace(tmp_path, reshard, traces):
    """Six blocks compile once (Dynamo frames and traced graphs counted): they share SimpleFSDP's
    parametrized class and one backend. Under reshard "default" the last block keeps its gathered
    weights, a different graph: two traces (the control that the counters do count per block). The
    blocks' recompile limit is set per compiled function: Dynamo's global limits stay unchanged."""
    from torch._dynamo.utils import counters

    counters.clear()
    limits = (torch._dynamo.config.recompile_limit, torch._dynamo.config.accumulated_recompile_limit)
    cfg = compiled(tmp_path, "transformer_block", parallelism__fsdp_reshard_after_forward=reshard)
    report = compile_report(cfg, 2, tiny_args(n_layers=6))
    assert (torch._dynamo.config.recompile_limit, torch._dynamo.config.accumulated_recompile_limit) == limits
    assert counters["stats"]["unique_graphs"] == traces
    assert report["traces"] == traces and report["units"] == 6
    # The counts are per step, all six blocks included.
    assert report["dp"]["all_gather"] == {"before": 6 * PER_BLOCK, "after": 6}


@pytest.mark.slow
def test_blocks_compile_where_torch_compile_takes_no_recompile_limit(tmp_path, monkeypatch):
    """torch 2.11's `torch.compile` has no `recompile_limit` keyword: per-block compile then leaves it out
    and Dynamo's global limit applies (one model's identical blocks share one entry)."""
    real = torch.compile
    seen: list[dict] = []

    def compile_2_11(
        model=None, *, fullgraph=False, dynamic=None, backend="inductor", mode=None, options=None, disable=False
    ):
        seen.append({"fullgraph": fullgraph})
        return real(
            model, fullgraph=fullgraph, dynamic=dynamic, backend=backend, mode=mode, options=options, disable=disable
        )

    monkeypatch.setattr(torch, "compile", compile_2_11)
    report = compile_report(compiled(tmp_path, "transformer_block"), 2, ARGS)
    assert len(seen) == N and report["units"] == N and report["dp"]["all_gather"]["after"] == N


def test_inductor_settings_scoped_to_bucketed_units(fake_world, monkeypatch):
    """The bucketed unit's inductor compile gets the decided settings as per-compile patches (nothing
    global changes); an unbucketed unit gets none of them."""
    import torch._inductor.compile_fx as compile_fx_module
    from torch._inductor import config as inductor_config

    from titanlite.compile.compiler import BUCKETING_INDUCTOR_CONFIG, _Backend
    from titanlite.compile.report import CompileReport

    seen = []
    monkeypatch.setattr(compile_fx_module, "compile_fx", lambda gm, inputs, **kw: seen.append(kw["config_patches"]))
    report = CompileReport({}, {}, 0, None, None)
    bucketing = BucketingPass("transformer_block", True, (BLOCK_BUCKET,), True, None, True)
    before = {k: getattr(inductor_config, k) for k in BUCKETING_INDUCTOR_CONFIG}
    for b in (bucketing, None):
        _Backend("inductor", RecomputeTagPass(()), b, report, report.add_unit("u", False))(_traced(fake_world), [])
    assert {k: seen[0][k] for k in BUCKETING_INDUCTOR_CONFIG} == BUCKETING_INDUCTOR_CONFIG
    assert seen[0]["reorder_for_compute_comm_overlap"] is False
    assert not set(BUCKETING_INDUCTOR_CONFIG) & set(seen[1])
    assert {k: getattr(inductor_config, k) for k in BUCKETING_INDUCTOR_CONFIG} == before


@pytest.mark.parametrize("degree", [2, 1])
def test_what_a_parallelism_asks_of_compiled_code_comes_from_its_unit(monkeypatch, degree):
    """The compiler names no parallelism: a unit of the order that this mesh runs gives its inductor settings
    (`compile_options`, in the order: float8's first) and its graph breaks (`graph_break`: that block compiles around
    its eager code). Negative control: the same unit off (degree 1) asks nothing. (`torch.compile` is
    replaced by a recorder: nothing is traced.)"""
    with torch.device("meta"):
        model = Transformer(ARGS, seq_len=8)
    units = llama_units(model)
    first = next(iter(units.blocks.values()))
    toy = ParallelismUnit(
        "toy",
        on=lambda cfg, dims: degree > 1,
        rules=lambda *args: None,
        apply=lambda applied: {},
        compile_options=lambda cfg: {"max_autotune": False},
        graph_break=lambda block: block is first,
    )
    monkeypatch.setattr(parallelize, "PARALLELISMS", (float8.UNIT, toy))
    seen: list[tuple[bool, dict]] = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append((kw["fullgraph"], kw.get("options"))) or fn)
    cfg = config(
        compile__enable=True,
        compile__backend="inductor",
        compile__bucketing="none",
        compile__scope="block",
        float8__enable=True,
        float8__recipe="rowwise",
        float8__emulate=True,
        parallelism__dp_impl="fsdp2",  # no graph passes: the blocks compile with `options`
    )
    dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, world_size=1)
    assert apply_compile(model, units, {}, cfg, dims, ReshardPolicy.of("default", N)) is None
    options = {"emulate_precision_casts": True} | ({"max_autotune": False} if degree > 1 else {})
    assert seen == [(degree == 1 or i > 0, options) for i in range(N)]


AUTO_BUCKETING = torch_support.supports("compile.bucketing = auto", torch.__version__)
needs_auto_bucketing = pytest.mark.skipif(not AUTO_BUCKETING, reason="compile.bucketing = auto needs a newer torch")


@needs_auto_bucketing
@pytest.mark.slow
@pytest.mark.parametrize("scope", ["block", "model"])
def test_auto_bucketing_buckets_gathers_and_reduce_scatters(tmp_path, scope):
    cfg = compiled(tmp_path, "auto", scope, compile__cost_model="config")
    report = compile_report(cfg, 2, ARGS)
    dp = report["dp"]
    limit = N if scope == "block" else N + 2
    assert dp["all_gather"]["after"] <= limit < dp["all_gather"]["before"]
    # The last block's backward has no re-gathers, so torch's pre-bucketing finds no FSDP group there;
    # its reduce-scatters are bucketed all the same.
    assert dp["reduce_scatter"]["after"] <= limit < dp["reduce_scatter"]["before"]
    assert report["cost_model"]["comm_latency_us"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("policy,regathered,reorder", [("never", 0, False), ("always", N * PER_BLOCK + 2, True)])
def test_reshard_after_forward_policy_under_compile(tmp_path, policy, regathered, reorder):
    """`always` re-gathers everything saved for backward (not the embedding); `never` nothing. Without
    reordering the buckets are the same, only left where the first collective of each was."""
    cfg = compiled(
        tmp_path, "transformer_block", "model", parallelism__fsdp_reshard_after_forward=policy, compile__reorder=reorder
    )
    dp = compile_report(cfg, 2, ARGS)["dp"]
    assert dp["all_gather"]["after"] == N + 2 and dp["reduce_scatter"]["after"] == N + 2
    assert dp.get("backward_all_gather", {"before": 0})["before"] == regathered
    if regathered:
        assert dp["backward_all_gather"]["after"] == N + 1  # each block, [norm, output]


@pytest.mark.slow
def test_counts_are_split_by_mesh_dim_under_tensor_parallelism(tmp_path):
    cfg = compiled(tmp_path, "transformer_block", parallelism__tensor_parallel_degree=2)
    report = compile_report(cfg, 4, ARGS)
    assert report["dp"]["all_gather"] == {"before": N * PER_BLOCK, "after": N}
    # Sequence parallelism's activation collectives are not FSDP's: counted under tp, never bucketed.
    tp = report["tp"]
    assert tp["all_gather"]["before"] == tp["all_gather"]["after"] == 2 * N
    assert tp["forward_reduce_scatter"]["before"] == tp["forward_reduce_scatter"]["after"] == 2 * N


# --- the passes and the counting, on small graphs ---------------------------------------------------------


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


def _traced(group: str) -> torch.fx.GraphModule:
    def fn(x, w):
        g = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_gather_into_tensor(w, 2, group))
        r = torch.ops._c10d_functional.reduce_scatter_tensor(x @ g, "avg", 2, group)
        return torch.ops._c10d_functional.wait_tensor(r)

    return make_fx(fn, tracing_mode="fake")(torch.randn(8, 8), torch.randn(4, 8))


def test_counting_sees_collectives_inside_control_deps(fake_world):
    """inductor's overlap ordering wraps collectives in `control_deps` subgraphs: they still count."""
    from torch._inductor.fx_passes.control_dependencies import control_deps, preserve_node_ordering

    gm = _traced(fake_world)
    assert [c.kind for c in graph_collectives(gm)] == ["all_gather", "reduce_scatter"]
    c10d = torch.ops._c10d_functional
    (ag,) = gm.graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor.default)
    (rs,) = gm.graph.find_nodes(op="call_function", target=c10d.reduce_scatter_tensor.default)
    preserve_node_ordering(gm.graph, {rs: OrderedSet([ag])})
    assert gm.graph.find_nodes(op="call_function", target=control_deps)
    assert not gm.graph.find_nodes(op="call_function", target=c10d.reduce_scatter_tensor.default)
    assert [c.kind for c in graph_collectives(gm)] == ["all_gather", "reduce_scatter"]


def test_cost_model_estimates_collectives_and_is_quantised(fake_world):
    cost = CostModel.from_config(100.0, 8.0, 250.0, 1.0).quantised()
    assert cost.comm_latency == 2.0**-12 and cost.flops == 2.0**37
    gm = _traced(fake_world)
    ag = next(n for n in gm.graph.nodes if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default)
    mm = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)
    assert cost.collective_ms(mm) is None  # compute stays with torch's roofline (fed by `roofline()`)
    small, big = cost.collective_ms(ag), cost.collective_ms(ag, override_size=2**24)
    assert small == pytest.approx(1e3 * (cost.comm_latency + 8 * 8 * 4 / 2 / cost.comm_bandwidth))
    assert big > small
    assert cost.bucket_cap_mb() == pytest.approx(10 * cost.comm_latency * cost.comm_bandwidth / 2**20)


def test_passes_have_stable_uuids():
    """The uuid enters inductor's FX graph cache key: equal for equal settings, else different."""
    cost = CostModel.from_config(100.0, 8.0, 250.0, 1.0).quantised()
    other = CostModel.from_config(100.0, 8.0, 2500.0, 1.0).quantised()

    def make(mode, cost_model=cost, plans=(BLOCK_BUCKET,)):
        return BucketingPass(mode, True, plans, block_scope=True, cost=cost_model, insert_overlap_deps=True).uuid()

    assert make("auto") == make("auto") and make("auto") != make("auto", other)
    assert make("transformer_block") == make("transformer_block", other)  # the manual plan ignores costs
    assert make("transformer_block") != make("transformer_block", plans=("layers.0",))
    assert RecomputeTagPass(()).uuid() == RecomputeTagPass(()).uuid() != RecomputeTagPass(("",)).uuid()


def test_module_fqn_reads_dynamo_module_paths():
    assert module_fqn("L['self'].layers.0.attention.wq") == "layers.0.attention.wq"
    assert module_fqn("L['self']._modules['layers']['3']._modules['ffn_norm']") == "layers.3.ffn_norm"
    assert module_fqn("L['self']") == ""


def test_invalid_combinations_are_config_errors():
    with torch.device("meta"):
        model = Transformer(ARGS, seq_len=8)
    units = llama_units(model)
    dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=1, world_size=2)
    cfg = config(compile__enable=True, compile__bucketing="auto", parallelism__dp_impl="fsdp2")
    with pytest.raises(ConfigError, match="SimpleFSDP"):
        apply_compile(model, units, {}, cfg, dims, ReshardPolicy.of("default", len(units.blocks)))
    # Full checkpointing in a whole-model graph is recompute tags, which need SimpleFSDP's passes.
    cfg = config(
        compile__enable=True, compile__scope="model", activation_checkpoint__mode="full", parallelism__dp_impl="fsdp2"
    )
    ac = apply_ac(units.blocks, cfg.activation_checkpoint)
    assert set(ac) == set(units.blocks) and all(a.mode == "full" for a in ac.values())
    with pytest.raises(ConfigError, match="scope=model with full activation checkpointing"):
        apply_compile(model, units, ac, cfg, dims, ReshardPolicy.of("default", len(units.blocks)))
    assert not any(a.in_graph for a in ac.values())


# --- numerical parity through the parity worker ----------------------------------------------------------

COMPILED = "--compile.enable"  # aot_eager: the parity worker's backend
SHARD2 = "--parallelism.data_parallel_shard_degree 2"
# Full activation checkpointing in one graph (scope model: recompute tags), and in per-block graphs with
# the eager prefetcher (scope prefetch, what auto compiles under full AC; reshard default and always), 6 blocks
# as the debug model: parity with one process and with eager full checkpointing (FULL_AC_EAGER, same
# launch), and the compile report's overlap counts (at least 5 prefetched all-gathers and 5 overlapped
# reduce-scatters).
FULL_AC = f"{SHARD2} --activation_checkpoint.mode full"
FULL_AC_EAGER = Case(FULL_AC, layers=6)
FULL_AC_COMPILED = [Case(f"{COMPILED} {FULL_AC} --compile.bucketing transformer_block --compile.scope model", layers=6)]
FULL_AC_PREFETCH = [
    Case(f"{COMPILED} {FULL_AC} --compile.bucketing transformer_block", layers=6),
    # aot_eager: the prefetcher and its overlap are the same under either backend; inductor's code for
    # prefetched blocks under full AC runs in the bf16 case below, its fp32 numerics in CASES_2's block case.
    Case(
        f"{COMPILED} {FULL_AC} --compile.bucketing transformer_block --parallelism.fsdp_reshard_after_forward always",
        layers=6,
    ),
]
CASES_2 = [
    f"{COMPILED} {SHARD2} --compile.bucketing transformer_block --compile.scope block",
    f"{COMPILED} {SHARD2} --compile.bucketing auto --compile.scope model",
    f"{COMPILED} {SHARD2} --compile.bucketing transformer_block --compile.scope model"
    " --activation_checkpoint.mode selective",
    f"{COMPILED} {SHARD2} --compile.bucketing auto --activation_checkpoint.mode full --compile.scope block",
    # reshard "always" makes every block's graph identical: blocks 1 and 2 come from the FX graph cache.
    f"{COMPILED} {SHARD2} --compile.bucketing transformer_block --compile.backend inductor"
    " --parallelism.fsdp_reshard_after_forward always --compile.scope block",
    FULL_AC_EAGER,
    *FULL_AC_COMPILED,
    *FULL_AC_PREFETCH,
]
# dp x tp with compiled blocks runs in the 4-rank launch of tests/runs/test_parallel_parity.py.
# bf16 parameters / fp32 reduction (the GPU recipe) under each bucketing mode, against eager SimpleFSDP in
# the same precision (bf16 rounding makes the fp32 reference unreachable). Same launch as CASES_2.
BF16 = f"{SHARD2} --training.mixed_precision_param bfloat16 --training.mixed_precision_reduce float32"
BF16_EAGER = [BF16]
BF16_COMPILED = [
    f"{COMPILED} {BF16} --compile.bucketing auto",
    f"{COMPILED} {BF16} --compile.bucketing transformer_block --parallelism.fsdp_reshard_after_forward always",
    f"{COMPILED} {BF16} --compile.bucketing transformer_block --activation_checkpoint.mode full"
    " --compile.backend inductor",  # prefetch
]
BF16_LOSS_REL = 1e-3
if not AUTO_BUCKETING:  # an older torch runs the other cases
    CASES_2, BF16_COMPILED = (
        [c for c in cases if as_case(c).settings().get("compile.bucketing") != "auto"]
        for cases in (CASES_2, BF16_COMPILED)
    )


def _parity(cases, nproc, tmp_path):
    records = parity(cases, nproc, tmp_path, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    fp32 = [r for r in records if r["config"]["training"]["mixed_precision_param"] == "float32"]
    check_parity(fp32)
    for r in records:  # the bucketed graphs are the ones that ran
        dp = r.get("compile_report", {}).get("dp")
        if r["config"]["compile"]["bucketing"] == "none":
            assert dp is None or dp["all_gather"]["after"] == dp["all_gather"]["before"], r["case"]
            continue
        assert dp["all_gather"]["after"] < dp["all_gather"]["before"], r["case"]
        assert dp["reduce_scatter"]["after"] < dp["reduce_scatter"]["before"], r["case"]
    return records


@pytest.mark.slow
def test_compiled_parity_2_ranks(tmp_path):
    records = _parity(CASES_2 + BF16_EAGER + BF16_COMPILED, 2, tmp_path)
    full_eager = records[CASES_2.index(FULL_AC_EAGER)]
    first = CASES_2.index(FULL_AC_EAGER) + 1
    for r in records[first : first + len(FULL_AC_COMPILED)]:
        diffs = [abs(a - b) / abs(b) for a, b in zip(r["losses"], full_eager["losses"])]
        assert max(diffs) <= LOSS_REL, (r["case"], diffs)
        report = r["compile_report"]
        assert report["scope"] == "model", r["case"]
        assert report["prefetched_all_gathers"] >= 5 and report["overlapped_reduce_scatters"] >= 5, r["case"]
    for r in records[first + len(FULL_AC_COMPILED) : len(CASES_2)]:
        diffs = [abs(a - b) / abs(b) for a, b in zip(r["losses"], full_eager["losses"])]
        assert max(diffs) <= LOSS_REL, (r["case"], diffs)
        report = r["compile_report"]
        assert report["scope"] == "prefetch" and report["traces"] == 2, r["case"]  # one block trace + eager unit
        assert report["prefetched_all_gathers"] >= 5 and report["overlapped_reduce_scatters"] >= 5, r["case"]
    eager, compiled = records[len(CASES_2)], records[len(CASES_2) + 1 :]
    assert eager["loss_rel"] > 1e-5  # bf16 really ran: fp32 rounding alone stays below this
    for r in compiled:
        diffs = [abs(a - b) / abs(b) for a, b in zip(r["losses"], eager["losses"])]
        assert max(diffs) <= BF16_LOSS_REL, (r["case"], diffs)
        assert r["loss_rel"] > 1e-5, r["case"]  # the compiled run computed in bf16 too


@needs_auto_bucketing
def test_auto_bucketing_estimates_analytically_on_every_device(fake_world, monkeypatch):
    """Without a CPU cost model (the CUDA path) torch's scheduler still gets analytical estimates: its
    default benchmarks nodes on the GPU and syncs the results over the world for every graph."""
    import torch._inductor.fx_passes.overlap_scheduling as scheduling
    from torch._inductor import config as inductor_config

    seen = []
    options = inductor_config.aten_distributed_optimizations
    monkeypatch.setattr(
        scheduling,
        "schedule_overlap_bucketing_from_inductor_configs",
        lambda gm: seen.append((options.compute_estimator, options.collective_estimator)),
    )
    BucketingPass("auto", True, (BLOCK_BUCKET,), block_scope=True, cost=None, insert_overlap_deps=False)(
        _traced(fake_world).graph
    )
    assert seen == [("analytical", "analytical")]


@pytest.mark.slow
def test_a_warm_compile_cache_gives_each_rank_its_own_graphs(tmp_path):
    """Two launches of the same tp 2 run in one compile cache: the second (warm) repeats the first's loss.
    Loss-parallel cross-entropy bakes each rank's vocab offset into its graph while torch keys the cached
    graph on what is equal across ranks; under one key every rank ran one rank's graph (loss 12.38
    instead of 8.13). The ranks share the cache folder; each finds its own graphs there (the warm launch
    adds none)."""
    run = [*SMALL, "--training.steps", "1", "--parallelism.tensor_parallel_degree", "2"]
    run += ["--compile.enable", "--compile.components", "loss"]
    cache = tmp_path / "inductor"

    def graphs() -> list[str]:
        return sorted(p.name for p in (cache / "fxgraph").rglob("*") if p.is_file())

    cold = train(tmp_path / "cold", 2, *run, launcher="run_train").ok()
    cold_graphs = graphs()
    warm = train(tmp_path / "warm", 2, *run, launcher="run_train").ok()
    assert warm.losses == cold.losses and len(cold.losses) == 1
    assert not any(p.name.startswith("rank") for p in cache.iterdir())  # one folder for the host's ranks
    assert cold_graphs and graphs() == cold_graphs, (cold_graphs, graphs())
