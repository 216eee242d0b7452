"""`ParallelDims` is the one place that names the degrees: the checkpoint, the trainer, validation, the step
and the tools ask it (the replica's width, the batch split, the meshes a loss is averaged over, the layout a
checkpoint records, the start-up words, the config keys a tool sets) and read no degree themselves. The
record a checkpoint stores keeps the keys and the log words it had, so earlier checkpoints resume alike."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from titanlite.parallelisms.parallel_dims import (
    ParallelDims,
    WorldLayout,
    degree_overrides,
    reset_to_data_parallel,
)

ROOT = Path(__file__).resolve().parents[3] / "titanlite"
DEGREE_NAMES = {"cp", "tp", "ep", "pp", "efsdp"}
"""The degrees by their dim names: a variable so named holds one."""
DEGREE_ATTRIBUTES = {
    *(f"{d}{suffix}" for d in ("cp", "tp", "ep", "pp") for suffix in ("", "_enabled", "_mesh", "_comm")),
    "efsdp",
    "efsdp_mesh",
    "degree",
}
"""A degree, whether it is on, its mesh, its collectives' time, a unit's degree: reads of these off an object
are reads of a degree."""
DEGREE_WORDS = re.compile(r"(context|tensor|expert|pipeline)_parallel_degree|\b(cp|tp|ep|pp)_degree\b")
"""The degrees' config keys and a checkpoint marker's keys."""
SCANNED = ["checkpoint", "run/trainer.py", "run/validation.py", "run/step.py", "run/loader.py", "tools"]
"""The code that must not name a degree (titanlite/...)."""
NOT_YET: set[tuple[str, str]] = set()
"""(file, name) reads the scan still allows: none."""


def degree_names(source: str) -> list[tuple[int, str]]:
    """(line, name) of every degree `source`'s code reads or spells (its comments and docstrings aside)."""
    tree = ast.parse(source)
    prose = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (node.attr in DEGREE_ATTRIBUTES or DEGREE_WORDS.search(node.attr)):
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            found += [(node.lineno, m.group(0)) for m in DEGREE_WORDS.finditer(node.value)]
        elif isinstance(node, ast.Name) and (node.id in DEGREE_NAMES or DEGREE_WORDS.search(node.id)):
            found.append((node.lineno, node.id))
    return found


def scanned_files() -> list[Path]:
    files = []
    for entry in SCANNED:
        path = ROOT / entry
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


def test_no_code_outside_the_parallelisms_names_a_degree():
    """The checkpoint, trainer, validation, step, loader and tools code reads no degree and spells no
    degree's key; the known exceptions are each still there (else the list goes stale)."""
    hits, seen = [], set()
    for path in scanned_files():
        rel = path.relative_to(ROOT).as_posix()
        for line, name in degree_names(path.read_text()):
            if (rel, name) in NOT_YET:
                seen.add((rel, name))
            else:
                hits.append(f"titanlite/{rel}:{line}: {name}")
    assert not hits, "degrees named outside ParallelDims:\n" + "\n".join(hits)
    assert seen == NOT_YET


def test_the_scan_catches_a_degree_read_and_leaves_prose_alone():
    """Negative control: a degree read, a config key, a marker key and a degree's mesh are each caught in a
    real scanned file's code; its docstrings and comments, which speak of the degrees, are not."""
    source = (ROOT / "run/validation.py").read_text()
    assert "context parallelism" in source and degree_names(source) == []
    injected = source.replace(
        "        for mesh in self.plan.dims.loss_meshes:",
        "        width = self.plan.dims.cp * self.plan.cfg.parallelism.tensor_parallel_degree\n"
        '        print({"tp_degree": width}, self.plan.dims.cp_mesh)\n'
        "        for mesh in self.plan.dims.loss_meshes:",
    )
    assert injected != source
    names = sorted(name for _, name in degree_names(injected))
    assert names == ["cp", "cp_mesh", "tensor_parallel_degree", "tp_degree"]
    assert degree_names('"""tp and cp ranks read the same tensor_parallel_degree."""\n# dims.cp\nx = 1\n') == []
    read = "pp, dp = stages, 2\nx = plan.pipeline.degree + est.tp_comm\n"
    assert sorted(name for _, name in degree_names(read)) == ["degree", "pp", "tp_comm"]


def test_the_checkpoint_layout_keeps_its_marker_keys_and_reads_markers_without_cp_and_ep():
    """The marker's keys are those checkpoints have stored (a marker from before context and expert
    parallelism, without their keys, reads as cp 1, ep 1), and the resume's log words are unchanged."""
    dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=2, world_size=8, cp=2)
    marker = dims.world_layout.to_marker()
    assert marker == {"world_size": 8, "dp_degree": 2, "tp_degree": 2, "cp_degree": 2, "ep_degree": 1}
    assert WorldLayout.from_marker({**marker, "dp_impl": "simple_fsdp", "step": 3}) == dims.world_layout
    old = WorldLayout.from_marker({"world_size": 2, "dp_degree": 2, "tp_degree": 1, "step": 1})
    assert old == WorldLayout(2, 2) and old.replica_width == 1 and old != dims.world_layout
    assert old.describe() == "world 2, dp 2, tp 1"
    assert WorldLayout(4, 2, tp=1, cp=2, ep=2).describe() == "world 4, dp 2, cp 2, ep 2, tp 1"


@pytest.mark.parametrize(
    "degrees, width",
    [(dict(tp=2, cp=2, dp_shard=2), 4), (dict(tp=1, cp=2, dp_shard=4), 2), (dict(tp=2, pp=2, dp_shard=2), 2)],
)
def test_a_replica_is_replica_width_consecutive_ranks_per_stage(degrees, width):
    """The first rank of dp rank d (per pipeline stage) is `d * replica_width`: what a resume reads the data
    loader state of (checkpoint/rank_state.py) and what `dp_rank_of` lays out."""
    dims = ParallelDims(dp_replicate=1, world_size=8, **degrees)
    assert dims.replica_width == dims.world_layout.replica_width == width
    firsts = [r for r in range(dims.world_size // dims.pp) if r % width == 0]
    assert [dims.dp_rank_of(r) for r in firsts] == list(range(dims.dp))
    assert all(dims.dp_rank_of(r) == dims.dp_rank_of(r - r % width) for r in range(dims.world_size))


def test_the_words_a_run_and_the_dry_run_describe_the_layout_with():
    dims = ParallelDims(dp_replicate=1, dp_shard=4, tp=1, world_size=4, ep=2)
    assert dims.describe() == "mesh {'dp_shard': 4} (simple_fsdp, fully_shard; experts over ep 2 x efsdp 2)"
    assert dims.describe_degrees() == "dp_shard 4 (experts over ep 2 x efsdp 2)"
    cp = ParallelDims(dp_replicate=1, dp_shard=1, tp=2, world_size=4, cp=2)
    assert cp.describe_degrees() == "cp 2 x tp 2" and cp.describe_sequence(64) == "seq 64 / cp 2"
    assert cp.rank_tokens(64) == 32 and cp.sequences(3) == 3
    one = ParallelDims(dp_replicate=1, dp_shard=-1, tp=1, world_size=1)
    assert one.describe_degrees() == "dp_shard 1" and one.describe_sequence(64) == "seq 64"
    assert one.describe() == "mesh {'dp_shard': 1} (simple_fsdp, fully_shard)"


def test_degree_overrides_and_the_reset_to_data_parallelism_use_the_config_keys():
    from titanlite.config import JobConfig

    assert degree_overrides(pp=8, tp=4) == [
        "--parallelism.pipeline_parallel_degree",
        "8",
        "--parallelism.tensor_parallel_degree",
        "4",
    ]
    p = JobConfig().parallelism
    p.tensor_parallel_degree = p.context_parallel_degree = p.pipeline_parallel_degree = 2
    p.pipeline_parallel_split_points = ["layers.1"]
    reset_to_data_parallel(p)
    dims = ParallelDims.from_config(p, 8)
    assert (dims.dp_shard, dims.mesh_dim_names, p.pipeline_parallel_split_points) == (8, ("dp_shard",), [])
