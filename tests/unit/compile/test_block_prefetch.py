"""Compile scope `prefetch` (`compile/prefetch.py`, installing `parallelisms/data_parallel/block_prefetch.py`):
per-block graphs with SimpleFSDP's collectives issued eagerly one unit ahead.

Structure (one process, torch's fake process group, aot_eager, 3 blocks, full AC): the order in which the
prefetcher issues its collectives against the blocks' compute, and the compile report's counts of them.
Numerics: the parity cases (`test_compile.py`, `test_parallel_parity.py`) train it against one process.
"""

from __future__ import annotations

import pytest
import torch
from builders import config

from harness import tiny_args
from titanlite.compile.scope import resolve_scope
from titanlite.errors import ConfigError
from titanlite.parallelisms import activation_checkpoint
from titanlite.parallelisms.data_parallel import block_prefetch
from titanlite.parallelisms.data_parallel.step_reduction import StepReduction
from titanlite.tools.dry_run import compile_report

N = 3
PER_BLOCK = 9  # wq wk wv wo w1 w2 w3 + two norms
ROOT = 3  # tok_embeddings, norm, output


def prefetched(tmp_path, **over):
    base = dict(
        compile__enable=True,
        compile__backend="aot_eager",
        compile__bucketing="transformer_block",
        compile__scope="prefetch",
        activation_checkpoint__mode="full",
    )
    return config(tmp_path, **{**base, **over})


@pytest.fixture(autouse=True)
def inductor_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))


def test_collectives_issued_one_unit_ahead(tmp_path, monkeypatch):
    """Forward: block i+1's gather starts before block i computes. Backward (reshard default: blocks 0
    and 1 freed, the last block kept): each unit's reduce-scatter starts before the next block's
    backward (its recompute), and block i-1's re-gather before block i's recompute. The events are the
    prefetcher's flat gathers, the reductions' starts and the checkpointed blocks' bodies (forward,
    then recompute in reverse)."""
    events: list[tuple[str, int]] = []
    names: dict[int, str] = {}
    install, start_gather, start_reduction = block_prefetch.install, block_prefetch._start_gather, StepReduction._start
    checkpoint = activation_checkpoint.checkpoint

    def install_recorded(*args, **kwargs):
        prefetch = install(*args, **kwargs)
        names.update({id(g): unit.name for unit in prefetch.units for g, _ in unit.pairs})
        return prefetch

    def gather_recorded(pairs):
        events.append(("gather", id(pairs[0][0])))
        return start_gather(pairs)

    def reduction_recorded(self, bucket):
        events.append(("reduce", id(bucket.members[0][0])))
        return start_reduction(self, bucket)

    def checkpoint_recorded(fn, *args, **kwargs):
        def body(*a):
            events.append(("run", 0))
            return fn(*a)

        return checkpoint(body, *args, **kwargs)

    monkeypatch.setattr(block_prefetch, "install", install_recorded)
    monkeypatch.setattr(block_prefetch, "_start_gather", gather_recorded)
    monkeypatch.setattr(StepReduction, "_start", reduction_recorded)
    monkeypatch.setattr(activation_checkpoint, "checkpoint", checkpoint_recorded)
    compile_report(prefetched(tmp_path), 2, tiny_args(n_layers=N))
    seen = [f"{kind} {names[key]}" if kind != "run" else "run" for kind, key in events]
    assert seen == [
        # forward: the embedding's gather, then each unit's pre-hook starts the next unit's
        "gather tok_embeddings",
        "gather layers.0",
        "gather layers.1",
        "run",  # block 0
        "gather layers.2",
        "run",  # block 1
        "gather norm,output",
        "run",  # block 2
        # backward: [norm, output] reduced before block 2's backward, which starts block 1's re-gather
        "reduce norm,output",
        "gather layers.1",
        "run",  # block 2 recomputed
        "reduce layers.2",
        "gather layers.0",
        "run",  # block 1 recomputed
        "reduce layers.1",
        "run",  # block 0 recomputed
        "reduce layers.0",
        "reduce tok_embeddings",
    ]


def test_report_counts_the_eager_collectives(tmp_path):
    """One flat all-gather and one reduce-scatter per unit ([embedding], each block, [norm, output]) and a
    re-gather per freed block; overlapped: each unit's gather and reduce-scatter whose neighbour is a
    block, and every re-gather (the debug model's 6 blocks: 11 and 6, as one whole-model graph)."""
    report = compile_report(prefetched(tmp_path), 2, tiny_args(n_layers=N))
    dp = report["dp"]
    assert report["scope"] == "prefetch" and report["eager_params"] == 0
    assert dp["all_gather"] == {"before": N * PER_BLOCK + ROOT, "after": N + 2}
    assert dp["reduce_scatter"] == {"before": N * PER_BLOCK + ROOT, "after": N + 2}
    assert dp["backward_all_gather"] == {"before": (N - 1) * PER_BLOCK, "after": N - 1}
    assert report["prefetched_all_gathers"] == N + (N - 1) and report["overlapped_reduce_scatters"] == N
    assert report["traces"] == 2  # one trace for every block, and the eager unit
    assert not report["gradients_reduced_outside_graphs"]


@pytest.mark.parametrize(
    "over,why",
    [
        ({"activation_checkpoint__mode": "selective"}, "activation_checkpoint.mode full"),
        ({"parallelism__dp_impl": "fsdp2", "compile__bucketing": "none"}, "SimpleFSDP data parallelism"),
    ],
)
def test_refused_where_the_prefetcher_does_not_apply(tmp_path, over, why):
    with pytest.raises(ConfigError, match=f"compile.scope=prefetch needs {why}"):
        compile_report(prefetched(tmp_path, **over), 2, tiny_args(n_layers=N))


@pytest.mark.parametrize(
    "over,pp,scope",
    [
        ({}, 1, "prefetch"),  # the 70B / 405B recipe: full AC, SimpleFSDP, transformer_block bucketing
        ({"activation_checkpoint__mode": "selective"}, 1, "model"),
        ({"activation_checkpoint__mode": "none"}, 1, "model"),
        ({}, 2, "model"),
        ({"parallelism__gradient_reduction": "per_step"}, 1, "model"),
        ({"training__global_batch_size": 16, "training__local_batch_size": 4}, 1, "model"),  # 2 per step on dp 2
        ({"training__global_batch_size": 8, "training__local_batch_size": 4}, 1, "prefetch"),  # one per step
        ({"compile__bucketing": "auto"}, 1, "model"),
        ({"compile__reorder": False}, 1, "model"),
        ({"compile__bucketing": "none"}, 1, "block"),
    ],
)
def test_auto_is_prefetch_only_where_the_prefetcher_applies(tmp_path, over, pp, scope):
    """`auto` keeps one graph (or per-block graphs) wherever the prefetcher does not apply, and where a
    step accumulates (one graph keeps the gathered weights and reduces once per step; the prefetcher
    would regather and reduce in every backward)."""
    cfg = prefetched(tmp_path, compile__scope="auto", **over)
    assert resolve_scope(cfg, dp_enabled=True, ep=1, pp=pp, dp=2) == scope
    assert resolve_scope(cfg, dp_enabled=True, ep=2, pp=pp, dp=2) == "block"


@pytest.mark.slow
def test_float8_weights_are_prefetched_as_float8_bits(tmp_path, monkeypatch):
    """With `float8.all_gather` (tensorwise) the prefetcher's flat gathers carry bytes: a float8 layer's
    weight as its float8 bits (1 byte per element, handed to the layer as torchao's float8 tensor), the
    norms as their fp32 bytes; a block's buffer is then 49,152 + 512 bytes, where fp32 gathers 4 x 49,152
    + 512 (negative control: the same run without float8.all_gather). The compile report counts the same
    bytes (the dry run's count, `test_dry_run`), forward and for the freed blocks' re-gathers."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    from titanlite.models.llama3 import Transformer

    float8 = dict(float8__enable=True, float8__emulate=True, float8__filter_fqns=["output"])
    with torch.device("meta"):
        model = Transformer(tiny_args(n_layers=N), seq_len=16)
    block = {n.removeprefix("layers.0."): p.numel() for n, p in model.named_parameters() if n.startswith("layers.0.")}
    float8_numel = sum(n for name, n in block.items() if "norm" not in name)
    norms = sum(n for name, n in block.items() if "norm" in name)
    assert (float8_numel, norms) == (49_152, 128)
    start_gather, finish_gather = block_prefetch._start_gather, block_prefetch._finish_gather
    for all_gather, block_bytes in ((True, float8_numel + 4 * norms), (False, 4 * (float8_numel + norms))):
        buffers: dict[str, list[tuple[torch.dtype, int]]] = {}
        kept: set[type] = set()

        def gather_recorded(pairs, buffers=buffers):
            g = start_gather(pairs)
            name = "block" if tuple(pairs[0][1].shape) == (64, 64) else "root"  # a block's first: wq
            buffers.setdefault(name, []).append((g.out.dtype, g.out.numel() * g.out.element_size()))
            return g

        def finish_recorded(g, kept=kept):
            finish_gather(g)
            kept.update(type(gather.kept) for (gather, _), *_ in g.members)

        monkeypatch.setattr(block_prefetch, "_start_gather", gather_recorded)
        monkeypatch.setattr(block_prefetch, "_finish_gather", finish_recorded)
        cfg = prefetched(tmp_path / str(all_gather), **float8, float8__all_gather=all_gather)
        report = compile_report(cfg, 2, tiny_args(n_layers=N))
        # 3 blocks gathered in forward, blocks 0 and 1 again in backward; one flat buffer each.
        assert buffers["block"] == [(torch.uint8 if all_gather else torch.float32, block_bytes)] * (N + N - 1)
        assert all(dtype == (torch.uint8 if all_gather else torch.float32) for dtype, _ in buffers["root"])
        assert (Float8TrainingTensor in kept) == all_gather
        sizes = report["bucket_sizes_mb"]
        vocab_bytes = 4 * (257 * 64 * 2 + 64)  # embedding, output, final norm: fp32 either way
        assert sizes["all_gather"]["total"] == pytest.approx((N * block_bytes + vocab_bytes) / 2**20, abs=1e-4)
        assert sizes["backward_all_gather"]["total"] == pytest.approx((N - 1) * block_bytes / 2**20, abs=1e-4)
