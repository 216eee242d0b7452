"""Pipeline stage layouts and the meta-device split, in process (the schedules' parity is in
test_parallel_parity, through the trainer's own step)."""

from __future__ import annotations

import warnings

import pytest
import torch

from harness import tiny_args
from titanlite.config import Parallelism
from titanlite.errors import ConfigError
from titanlite.models.llama3 import Transformer
from titanlite.models.llama3.parallelize import llama_units
from titanlite.parallelisms.parallel_dims import ParallelDims
from titanlite.parallelisms.pipeline.unit import StageLayout, StageUnion, balanced_starts, keep_stage
from titanlite.tools.dry_run import fake_process_group


def plan(n_blocks: int = 6, local_batch: int = 8, **p) -> StageLayout:
    return StageLayout.of(Parallelism(**{f"pipeline_parallel_{k}": v for k, v in p.items()}), n_blocks, local_batch)


def test_balanced_split_counts_embedding_and_output_as_blocks():
    assert balanced_starts(6, 2) == (0, 3)
    # 8, 8, 9, 7 blocks: with the embedding and the output each stage costs 8 or 9 blocks.
    assert balanced_starts(32, 4) == (0, 8, 16, 25)
    assert balanced_starts(4, 4) == (0, 1, 2, 3)  # at least one block per stage
    assert balanced_starts(126, 16)[1] == 7


def test_stage_plan_ranks_stages_and_bubble():
    p = plan(degree=2, schedule="Interleaved1F1B", microbatch_size=2)
    assert (p.n_stages, p.microbatches) == (4, 4)
    assert p.stages_of(0) == (0, 2) and p.stages_of(1) == (1, 3)
    assert [list(p.blocks(s)) for s in range(4)] == [[0], [1, 2], [3, 4], [5]]
    assert p.bubble_fraction == pytest.approx(1 / 9)
    # One microbatch crosses the 4 stages in turn: each rank computes 2 of a step of 4, interleaved or not.
    one = plan(degree=2, schedule="Interleaved1F1B", microbatch_size=8)
    assert one.microbatches == 1 and one.bubble_fraction == pytest.approx(1 / 2)
    g = plan(degree=2, schedule="GPipe", split_points=[4])
    assert list(g.blocks(0)) == [0, 1, 2, 3] and g.in_flight(0) == 8
    assert plan(degree=4, n_blocks=8).in_flight(1) == 3  # 1F1B warm-up: p - rank


@pytest.mark.parametrize(
    "kw,fragment",
    [
        (dict(degree=4, stages_per_rank=2, schedule="Interleaved1F1B"), "8 pipeline stages"),
        (dict(degree=2, microbatch_size=8), "1 microbatches"),
        (dict(degree=2, microbatch_size=3), "not a multiple"),
        (dict(degree=4, schedule="Interleaved1F1B", microbatch_size=1, n_blocks=8, local_batch=9), "multiple of 2"),
        (dict(degree=2, split_points=[3, 4]), "expected 1 increasing"),
        (dict(degree=2, schedule="1F1B", stages_per_rank=2), "one stage per rank"),
    ],
)
def test_stage_plan_rejects_what_torch_cannot_run(kw, fragment):
    n_blocks, local = kw.pop("n_blocks", 6), kw.pop("local_batch", 8)
    with pytest.raises(ConfigError, match=fragment):
        plan(n_blocks, local, **kw)


def test_stages_keep_names_and_cover_the_model_once():
    """Each stage built on the meta device keeps its blocks' FQNs; the stages together hold every
    parameter exactly once; a rank's several stages form one module with the same names."""
    args = tiny_args(n_layers=4)
    with torch.device("meta"):
        whole = Transformer(args, seq_len=16)
    names = {n for n, _ in whole.named_parameters()}
    p = plan(n_blocks=4, degree=2, schedule="Interleaved1F1B")
    stages = []
    for s in range(p.n_stages):
        with torch.device("meta"):
            model = Transformer(args, seq_len=16)
        keep_stage(model, llama_units(model), p, s)
        stages.append(model)
    held = [{n for n, _ in m.named_parameters()} for m in stages]
    assert set().union(*held) == names and sum(map(len, held)) == len(names)
    assert "tok_embeddings.weight" in held[0] and "output.weight" in held[-1]
    assert all(n.startswith("layers.2.") for n in held[2])
    union = StageUnion([stages[1], stages[3]])  # pipeline rank 1's stages
    assert {n for n, _ in union.named_parameters()} == held[1] | held[3]
    x = torch.randn(2, 16, args.dim, device="meta")
    assert stages[1](x).shape == x.shape  # a middle stage maps hidden states to hidden states


def test_mesh_layout_puts_pp_outermost():
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, tp=2, world_size=8, pp=2)
    assert dims.dp_shard == 2 and dims.mesh_dim_names == ("pp", "dp_shard", "tp")
    assert dims.dim_names == ("dp_shard", "tp")
    assert [dims.pp_rank_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [dims.dp_rank_of(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_the_flattened_dp_mesh_is_kept_not_sliced_from_the_world_mesh():
    dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=2, world_size=16, pp=2)
    with fake_process_group(0, 16), warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when a flattened dim is sliced from the root mesh
        dims.build_mesh("cpu")
        assert dims.dp_mesh.mesh_dim_names == ("dp",) and dims.dp_mesh.size() == 4
        assert set(dims.process_groups()) == {"pp", "dp_replicate", "dp_shard", "tp", "dp"}
        with pytest.warns(UserWarning, match="flattened"):  # negative control: what the kept mesh avoids
            dims.world_mesh["dp"]


def test_tensor_parallel_stages_need_a_sequence_the_tp_ranks_split_evenly():
    """Under pipeline stages the hidden states pass sequence-sharded over tp: the tensor-parallel unit's rule
    refuses a sequence tp does not divide, before any rank; a sequence it divides plans."""
    from builders import config

    from titanlite.planning.run_plan import RunPlan

    layout = dict(parallelism__pipeline_parallel_degree=2, parallelism__tensor_parallel_degree=2)
    keys = dict(model__n_layers=4, training__local_batch_size=2, parallelism__pipeline_parallel_microbatch_size=1)
    with pytest.raises(ConfigError, match="training.seq_len 63 is not a multiple of tensor_parallel_degree 2"):
        RunPlan.build(config(None, layout, keys, training__seq_len=63), 4)
    assert RunPlan.build(config(None, layout, keys, training__seq_len=64), 4).dims.tp == 2
