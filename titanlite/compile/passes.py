"""Graph passes that make SimpleFSDP efficient under torch.compile, whose traces hold one all-gather per
parameter in forward and one reduce-scatter per gradient in backward.

`RecomputeTagPass` (joint graph, before partitioning) tags the parameter gathers `MUST_RECOMPUTE`
(reshard-after-forward: freed after forward and gathered again in backward; `MUST_SAVE` keeps them), and
in a whole-model graph the fully checkpointed blocks too. `BucketingPass` (forward/backward graphs, after
partitioning) merges the FSDP collectives into buckets and, with `reorder`, moves them to overlap compute
(`auto`: torch's overlap scheduler; `transformer_block`: torch's manual one, a bucket per module plan).
`CostModel`: the CPU figures torch's schedulers estimate runtimes with (its own estimators read GPU ones).
Both passes are `CustomGraphPass`es with a stable `uuid()`, so inductor's FX graph cache keys them.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections.abc import Iterator
from dataclasses import astuple, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.utils.checkpoint import CheckpointPolicy

from titanlite.compile.collectives import Collective, graph_collectives

_C10D = torch.ops._c10d_functional
# Far above any checkpoint region's id, so the partitioner's "save at the boundary of two AC regions"
# rule never overrides these tags.
_FSDP_AC_GRAPH_ID = 100_000


def _uuid(*parts: Any) -> bytes:
    return get_hash_for_files((__file__,), extra=repr(parts))


# --- module FQNs of graph nodes -------------------------------------------------------------------------


def module_fqn(stack_name: str) -> str:
    """Dynamo's module path (`L['self'].layers['0']._modules['wq']`) as an FQN (`layers.0.wq`)."""
    s = re.sub(r"^L\['self'\]", "", stack_name)
    s = re.sub(r"(?:\._modules)?\['([^']+)'\]", r".\1", s)
    return s.strip(".")


def node_module_stack(node: fx.Node) -> list[tuple[str, type]]:
    """The (FQN, class) stack of the modules that produced `node`; backward nodes carry the forward's."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    return [(module_fqn(name), cls) for name, cls in stack.values()]


def _in_prefixes(fqn: str, prefixes: tuple[str, ...]) -> bool:
    return any(p == "" or fqn == p or fqn.startswith(p + ".") for p in prefixes)


# --- recompute tags on the joint graph: reshard-after-forward, full activation checkpointing ---------------


def parameter_gathers(graph: fx.Graph) -> list[fx.Node]:
    """All-gathers fed by one graph input through single-input ops only: SimpleFSDP's parameter gathers.

    Activation all-gathers (tensor/sequence parallelism) depend on computation and are not matched.
    """
    out = []
    for node in graph.find_nodes(op="call_function", target=_C10D.all_gather_into_tensor.default):
        n = node.all_input_nodes[0]
        while n.op != "placeholder" and len(n.all_input_nodes) == 1:
            n = n.all_input_nodes[0]
        if n.op == "placeholder":
            out.append(node)
    return out


class RecomputeTagPass(CustomGraphPass):
    """The joint graph's recompute tags: reshard-after-forward of the parameter gathers, and full
    activation checkpointing of whole blocks inside a whole-model graph.

    Gathers: one whose module FQN lies under one of `saved` (`""` matches everything) is `MUST_SAVE`:
    its gathered weight stays alive from forward to backward. Every other gather is `MUST_RECOMPUTE`.
    The tags cover the single-input chain from the parameter (casts, padding), the all-gather, its wait,
    and the views of the waited result, so no alias of the full weight is saved by accident.

    Blocks: `checkpointed` names the fully checkpointed blocks (FQNs, forward order). Each forward
    operation of such a block is `MUST_RECOMPUTE` in a region of its own (`ac_graph_id` rising in
    forward order), except the block's outputs (values an operation outside the block reads: the
    residual stream), which are `MUST_SAVE`. The min-cut partitioner then saves what an eager
    checkpoint around each block saves and recomputes the rest in backward, placed just before the
    block's backward (its backward order mimics autograd's). Unlike torch's checkpoint inside a compiled
    region (which AOTAutograd rejects over DTensor inputs), the tags leave one graph in which the
    bucketing pass can prefetch the next block's gather during this block's recomputation.
    """

    def __init__(self, saved: tuple[str, ...], checkpointed: tuple[str, ...] = ()):
        self.saved, self.checkpointed = saved, checkpointed

    def __call__(self, graph: fx.Graph) -> None:
        if self.checkpointed:
            _tag_checkpointed_blocks(graph, self.checkpointed)
        for ag in parameter_gathers(graph):
            stack = node_module_stack(ag)
            fqn = stack[-1][0] if stack else ""
            policy = CheckpointPolicy.MUST_SAVE if _in_prefixes(fqn, self.saved) else CheckpointPolicy.MUST_RECOMPUTE
            for node in _gather_region(ag):
                node.meta["recompute"] = policy
                node.meta["ac_graph_id"] = _FSDP_AC_GRAPH_ID

    def uuid(self) -> bytes:
        return _uuid(type(self).__name__, self.saved, self.checkpointed)


def _tag_checkpointed_blocks(graph: fx.Graph, blocks: tuple[str, ...]) -> None:
    """Tag the forward operations of `blocks` as `RecomputeTagPass` describes."""
    backward: set[fx.Node] = set()  # the tangents and everything computed from them
    region: dict[fx.Node, int] = {}
    for node in graph.nodes:
        if (node.op == "placeholder" and "tangents" in str(node.target)) or any(
            n in backward for n in node.all_input_nodes
        ):
            backward.add(node)
        elif node.op == "call_function":
            fqns = [fqn for fqn, _ in node_module_stack(node)]
            index = next((i for i, b in enumerate(blocks) if any(f == b or f.startswith(b + ".") for f in fqns)), None)
            if index is not None:
                region[node] = index
    for node, index in region.items():
        output = any(u not in backward and region.get(u) != index for u in node.users)
        node.meta["recompute"] = CheckpointPolicy.MUST_SAVE if output else CheckpointPolicy.MUST_RECOMPUTE
        node.meta["ac_graph_id"] = index + 1


def _gather_region(ag: fx.Node) -> list[fx.Node]:
    region = [ag]
    n = ag.all_input_nodes[0]
    while n.op != "placeholder":
        region.append(n)
        n = n.all_input_nodes[0]
    frontier = [u for u in ag.users if u.target is _C10D.wait_tensor.default]
    while frontier:
        node = frontier.pop()
        region.append(node)
        frontier.extend(
            u
            for u in node.users
            if u.op == "call_function" and isinstance(u.target, torch._ops.OpOverload) and u.target.is_view
        )
    return region


# --- the CPU cost model ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CostModel:
    """Throughput figures for torch's runtime estimators on CPU: compute, memory and collectives.

    Collective time is `latency + wire_bytes / comm_bandwidth`, with ring wire bytes: (p-1)/p of the
    unsharded buffer for all-gather and reduce-scatter, twice that for all-reduce.
    """

    flops: float
    """Matmul FLOP/s of one rank."""
    mem_bandwidth: float
    """Bytes/s of a large copy (read + write)."""
    comm_latency: float
    """Seconds per collective, independent of size."""
    comm_bandwidth: float
    """Bytes/s per rank on the wire."""

    @classmethod
    def from_config(cls, gflops: float, mem_gbps: float, latency_us: float, comm_gbps: float) -> CostModel:
        return cls(gflops * 1e9, mem_gbps * 1e9, latency_us * 1e-6, comm_gbps * 1e9)

    @classmethod
    def measure(cls, group: dist.ProcessGroup | None, fallback: CostModel) -> CostModel:
        """Time a small matmul, a copy and (on a real gloo group) an all-gather; agree across ranks.

        Every rank must build the same model, or the schedulers would make different decisions and the
        ranks' graphs would not match: the figures are averaged over the world and then quantised.
        A fake process group has no wire to time: its collective figures come from `fallback`.
        """
        a = torch.randn(256, 256)
        flops = 2 * 256**3 * 8 / _best_seconds(lambda: [a @ a for _ in range(8)])
        big = torch.empty(4 * 2**20)
        mem = 2 * big.numel() * 4 / _best_seconds(lambda: big.clone())
        latency, comm_bw = fallback.comm_latency, fallback.comm_bandwidth
        if group is not None and dist.get_backend(group) == "gloo":
            p = group.size()
            tiny, wide = torch.zeros(1), torch.zeros(2**18)
            latency = _best_seconds(lambda: dist.all_gather_into_tensor(torch.empty(p), tiny, group=group), reps=20)
            t_wide = _best_seconds(
                lambda: dist.all_gather_into_tensor(torch.empty(p * wide.numel()), wide, group=group), reps=10
            )
            comm_bw = (p - 1) * wide.numel() * 4 / max(t_wide - latency, 1e-9)
        figures = torch.tensor([flops, mem, latency, comm_bw], dtype=torch.float64)
        if dist.is_initialized() and dist.get_backend() == "gloo":
            dist.all_reduce(figures, op=dist.ReduceOp.SUM)
            figures /= dist.get_world_size()
        return cls(*(float(x) for x in figures)).quantised()

    def quantised(self) -> CostModel:
        """Round every figure to a power of two: identical across ranks and mostly stable between runs, so
        the pass uuid (and with it the FX graph cache) rarely changes with timing noise (gloo timings on a
        loaded machine vary by up to 2x; `compile.cost_model = "config"` makes the uuid fully stable)."""
        return CostModel(*(2.0 ** round(math.log2(x)) for x in astuple(self)))

    def collective_ms(self, node: fx.Node, override_size: int | None = None) -> float | None:
        """`custom_runtime_estimation` for torch's schedulers: collectives only, None for other nodes."""
        coll = Collective.from_node(node)
        if coll is None:
            return None
        nbytes = override_size if override_size is not None else coll.nbytes
        p = coll.group_size
        wire = nbytes * (p - 1) / p * (2 if coll.kind == "all_reduce" else 1)
        return 1e3 * (self.comm_latency + wire / self.comm_bandwidth)

    def bucket_cap_mb(self) -> float:
        """Bucket size at which the fixed latency is 10% of a collective's time."""
        return 10 * self.comm_latency * self.comm_bandwidth / 2**20

    @contextlib.contextmanager
    def roofline(self) -> Iterator[None]:
        """Let torch's roofline estimate (`torch.utils._runtime_estimation`) use this model's figures.

        torch converts FLOPs as `(flops / 2) / (0.75 * peak)`; peak = flops / 1.5 makes that `flops / self.flops`.
        """
        import torch.utils._runtime_estimation as estimation

        figures = {
            "get_device_tflops": lambda dtype, device=None: self.flops / 1.5 / 1e12,
            "get_gpu_dram_gbps": lambda: self.mem_bandwidth / 1e9,  # torch 2.11-2.14
            "get_device_dram_gbps": lambda device=None: self.mem_bandwidth / 1e9,  # torch 2.15
        }
        saved = {name: getattr(estimation, name) for name in figures if hasattr(estimation, name)}
        for name in saved:
            setattr(estimation, name, figures[name])
        try:
            yield
        finally:
            for name, fn in saved.items():
                setattr(estimation, name, fn)

    def as_dict(self) -> dict[str, float]:
        return {
            "gflops": self.flops / 1e9,
            "mem_gbps": self.mem_bandwidth / 1e9,
            "comm_latency_us": self.comm_latency * 1e6,
            "comm_gbps": self.comm_bandwidth / 1e9,
        }


def _best_seconds(fn, reps: int = 5) -> float:
    fn()
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


# --- bucketing and reordering ---------------------------------------------------------------------------


class BucketingPass(CustomGraphPass):
    """Bucket (and with `reorder`, overlap) the FSDP collectives of a forward or backward graph.

    `plans` are `manual_overlap_bucketing` module plans (FQNs, or lists of FQNs sharing a bucket), used by
    `transformer_block`. A graph that holds a single block is compiled with `plans=("",)` and
    `block_scope=True`: every node belongs to the one plan, so identical blocks yield identical graphs and
    share one FX graph cache entry. `cost` is the CPU cost model (None on CUDA: torch's estimators).
    `last_collectives` holds the collectives of the last graph this pass produced (for the report).
    """

    def __init__(
        self,
        mode: str,
        reorder: bool,
        plans: tuple,
        block_scope: bool,
        cost: CostModel | None,
        insert_overlap_deps: bool,
    ):
        self.mode, self.reorder, self.plans, self.block_scope = mode, reorder, plans, block_scope
        self.cost, self.insert_overlap_deps = cost, insert_overlap_deps
        self.last_collectives: list[Collective] | None = None

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        with self.cost.roofline() if self.cost is not None else contextlib.nullcontext():
            if self.mode == "auto":
                self._auto(gm)
            else:
                self._manual(gm)
        gm.recompile()
        self.last_collectives = graph_collectives(gm)

    def _auto(self, gm: fx.GraphModule) -> None:
        from torch._inductor import config
        from torch._inductor.fx_passes.fsdp import (
            bucket_fsdp_reduce_scatter,
            identify_fsdp_groups,
            pre_bucket_fsdp_collectives,
        )
        from torch._inductor.fx_passes.overlap_scheduling import schedule_overlap_bucketing_from_inductor_configs

        cap = self.cost.bucket_cap_mb() if self.cost is not None else None
        if not identify_fsdp_groups(gm)[0]:
            # torch's pre-bucketing finds the FSDP groups through parameter all-gathers. A backward graph
            # without re-gathers (reshard "never", the last block under "default") has none, and torch
            # would leave most of its reduce-scatters unbucketed (30 -> 19 on a 3-block model): bucket
            # them with torch's SimpleFSDP reduce-scatter bucketing under the same size cap.
            bucket_fsdp_reduce_scatter(gm, bucket_cap_mb_by_bucket_idx=None if cap is None else lambda _: cap)
        if not self.reorder:
            pre_bucket_fsdp_collectives(gm, bucket_cap_mb=cap)
            return
        patch: dict[str, Any] = {
            "aten_distributed_optimizations.collective_bucketing": True,
            "aten_distributed_optimizations.insert_overlap_deps": self.insert_overlap_deps,
            # Analytical estimates on every device. torch 2.13's default benchmarks each compute node on
            # the GPU and, because benchmarks differ by rank, all-gathers the estimates over the world
            # (`all_gather_object`) for every compiled graph, FX-cache hits included. Analytical
            # estimates are the same on every rank from the shapes alone, so no sync is needed.
            "aten_distributed_optimizations.compute_estimator": "analytical",
            "aten_distributed_optimizations.collective_estimator": "analytical",
        }
        if self.cost is not None:
            patch.update(
                {
                    "aten_distributed_optimizations.custom_runtime_estimation": self.cost.collective_ms,
                    "aten_distributed_optimizations.pre_bucketing_fsdp_collectives_bucket_cap_mb": cap,
                }
            )
        with config.patch(patch):
            schedule_overlap_bucketing_from_inductor_configs(gm)

    def _manual(self, gm: fx.GraphModule) -> None:
        from torch._inductor.fx_passes.overlap_manual_scheduling import (
            ManualOverlapScheduler,
            manual_overlap_bucketing,
        )

        stack_fn = _whole_graph_stack if self.block_scope else node_module_stack
        plans = [list(p) if isinstance(p, tuple) else p for p in self.plans]
        if self.reorder:
            manual_overlap_bucketing(
                gm, module_bucket_plans=plans, insert_overlap_deps=self.insert_overlap_deps, module_stack_fn=stack_fn
            )
        else:
            ManualOverlapScheduler(
                gm, plans, insert_overlap_deps=False, module_stack_fn=stack_fn
            )._manual_bucket_collectives()

    def uuid(self) -> bytes:
        cost = astuple(self.cost) if self.cost is not None and self.mode == "auto" else None
        return _uuid(
            type(self).__name__, self.mode, self.reorder, self.plans, self.block_scope, cost, self.insert_overlap_deps
        )


BLOCK_BUCKET = "block"


def _whole_graph_stack(node: fx.Node) -> list[tuple[str, type]]:
    """Every node that came from a module belongs to the plan `BLOCK_BUCKET` (a graph of one block)."""
    return [(BLOCK_BUCKET, torch.nn.Module)] if node_module_stack(node) else []
