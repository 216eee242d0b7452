"""Parallel degrees -> one validated DeviceMesh with named dims.

The mesh holds the dims whose degree is > 1, in the order (pp, dp_replicate, dp_shard, cp, tp): tp ranks are
neighbours, data parallelism spans nodes and pipeline stages are the farthest apart. A single process is a
mesh of one `dp_shard` rank and gets the same plan as any world. Views: `dp` (the ranks that see different
data), `param_mesh` (dp_shard x cp flattened: parameters are sharded over the context-parallel ranks too, as
TorchTitan does), `expert_param_mesh` (that dim unflattened into (`efsdp`, `ep`)), `pp_mesh`, and the mesh
without `pp` a stage's plan runs on. This is the one module that names the degrees: the rest of the framework
asks here for what it needs of them, so adding a degree touches this module, the config schema and the
parallelism's unit only. The layouts: docs/parallelism.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titanlite.errors import ConfigError

DEGREE_KEYS: dict[str, str] = {
    "pp": "pipeline_parallel_degree",
    "dp_replicate": "data_parallel_replicate_degree",
    "dp_shard": "data_parallel_shard_degree",
    "cp": "context_parallel_degree",
    "tp": "tensor_parallel_degree",
    "ep": "expert_parallel_degree",
}
"""Each degree's key in config section `parallelism`, by its dim name."""


def degree_overrides(**degrees: int) -> list[str]:
    """Command-line overrides setting the given degrees (by dim name: `pp=8, tp=8`), in the order given."""
    return [arg for name, d in degrees.items() for arg in (f"--parallelism.{DEGREE_KEYS[name]}", str(d))]


WORLD_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The world mesh's dims, outermost first (expert parallelism splits dp_shard x cp, not the world)."""
DATA_PARALLEL = {name: -1 if name == "dp_shard" else 1 for name in DEGREE_KEYS}
"""Every degree of plain data parallelism, by dim name: 1, and the shard degree the rest of the world (-1)."""


def layout_overrides(**degrees: int) -> list[str]:
    """Command-line overrides setting every world mesh dim's degree: the given ones (by dim name), the others
    plain data parallelism's (`DATA_PARALLEL`)."""
    return degree_overrides(**({name: DATA_PARALLEL[name] for name in WORLD_DIMS} | degrees))


def reset_to_data_parallel(p: Any) -> None:
    """Config section `parallelism` (`p`) set to plain data parallelism (`DATA_PARALLEL`), with no pipeline
    split points, stage count or microbatch size."""
    for name, degree in DATA_PARALLEL.items():
        setattr(p, DEGREE_KEYS[name], degree)
    p.pipeline_parallel_split_points, p.pipeline_parallel_stages_per_rank = [], -1
    p.pipeline_parallel_microbatch_size = 1


_MARKER_KEYS = {"world_size": "world_size", "dp": "dp_degree", "tp": "tp_degree", "cp": "cp_degree", "ep": "ep_degree"}
"""`WorldLayout`'s fields by their keys in a checkpoint's completion marker."""


@dataclass(frozen=True)
class WorldLayout:
    """The parallel layout that wrote a checkpoint, as its completion marker records it: a resume on another
    one reshards (the data loader's states by `replica_width`, DCP the tensors). The marker's keys are fixed
    (`to_marker`); a degree recorded later than the first markers is read as 1 where a marker lacks it."""

    world_size: int
    dp: int
    tp: int = 1
    cp: int = 1
    ep: int = 1

    @property
    def replica_width(self) -> int:
        """Ranks of one data-parallel replica in one pipeline stage (cp x tp): rank `d * replica_width` is
        the first rank of dp rank `d`, the one that reads its data."""
        return self.cp * self.tp

    def first_rank_of(self, dp_rank: int) -> int:
        """The first global rank of data-parallel rank `dp_rank` in the first pipeline stage: the rank whose
        saved data loader state is that dp rank's."""
        return dp_rank * self.replica_width

    def to_marker(self) -> dict[str, int]:
        """The completion marker's entries."""
        return {key: getattr(self, name) for name, key in _MARKER_KEYS.items()}

    @classmethod
    def from_marker(cls, marker: dict) -> WorldLayout:
        """The layout a completion marker recorded (cp and ep: 1 in markers written without them)."""
        return cls(**{name: marker[key] for name, key in _MARKER_KEYS.items() if key in marker})

    def describe(self) -> str:
        """In words, for the resume's log line: `world 4, dp 2, cp 2, tp 1`."""
        extra = (f", cp {self.cp}" if self.cp > 1 else "") + (f", ep {self.ep}" if self.ep > 1 else "")
        return f"world {self.world_size}, dp {self.dp}{extra}, tp {self.tp}"


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    pp: int = 1
    cp: int = 1
    ep: int = 1
    """Expert-parallel degree: ranks of dp_shard x cp that split every MoE layer's experts."""
    tp_divisible: dict[str, int] = field(default_factory=dict)
    """Model sizes the tp degree must divide (e.g. {"n_heads": 32}), named in the error."""
    dp_impl: str = "simple_fsdp"
    disable_loss_parallel: bool = False
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _flat_dp: DeviceMesh | None = field(default=None, init=False, repr=False)
    """The data-parallel dims flattened into one (`dp`) when there are two: kept here, since slicing a
    flattened dim from the world mesh is deprecated by torch."""
    _param_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    """Under context parallelism: the data-parallel plan's mesh, dp_shard x cp flattened (`param_mesh`)."""
    _expert_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    """Under expert parallelism: dp_shard x cp unflattened into (efsdp, ep)."""
    _expert_param_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    """Under expert parallelism: the experts' data-parallel plan mesh, ([dp_replicate,] efsdp, ep)."""

    def __post_init__(self) -> None:
        pp_text = f"pipeline_parallel_degree {self.pp} x " if self.pp > 1 else ""
        cp_text = f" x context_parallel_degree {self.cp}" if self.cp > 1 else ""
        if self.dp_shard == -1:
            rest = self.pp * self.dp_replicate * self.cp * self.tp
            if self.world_size % rest:
                raise ConfigError(
                    f"parallelism: world size {self.world_size} is not divisible by {pp_text}"
                    f"data_parallel_replicate_degree {self.dp_replicate}{cp_text} x tensor_parallel_degree {self.tp}"
                )
            self.dp_shard = self.world_size // rest
        product = self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            pp_dim = f"pp={self.pp} x " if self.pp > 1 else ""
            cp_dim = f" x cp={self.cp}" if self.cp > 1 else ""
            raise ConfigError(
                f"parallelism: mesh {pp_dim}dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard}{cp_dim} "
                f"x tp={self.tp} = {product} does not equal the world size {self.world_size}"
            )
        for name, size in self.tp_divisible.items():
            if size % self.tp:
                raise ConfigError(
                    f"parallelism: tensor_parallel_degree {self.tp} does not divide the model's {name} {size}"
                )
        if self.ep > 1 and self.shard_degree % self.ep:
            raise ConfigError(
                f"parallelism: expert_parallel_degree {self.ep} must divide data_parallel_shard_degree "
                f"{self.dp_shard}{cp_text} (expert parallelism borrows those ranks)"
            )
        if self.dp_impl == "fsdp2" and self.dp_replicate > 1 and self.dp_shard * self.cp == 1:
            raise ConfigError(
                "parallelism: dp_impl=fsdp2 needs data_parallel_shard_degree > 1 "
                f"(got dp_replicate={self.dp_replicate} x dp_shard=1); use dp_impl=simple_fsdp for pure replication"
            )

    def __hash__(self) -> int:
        """By the degrees and the plan's choices (the meshes aside): a memory estimate's `Layout` holds the dims
        and the layout search keys its stage layouts by it."""
        degrees = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp, self.ep, self.world_size)
        return hash((degrees, self.dp_impl, self.disable_loss_parallel))

    @classmethod
    def from_config(cls, p: Any, world_size: int, tp_divisible: dict[str, int] | None = None) -> ParallelDims:
        """The dims of config section `parallelism` (`p`) for `world_size` ranks."""
        return cls(
            dp_replicate=p.data_parallel_replicate_degree,
            dp_shard=p.data_parallel_shard_degree,
            tp=p.tensor_parallel_degree,
            world_size=world_size,
            pp=p.pipeline_parallel_degree,
            cp=p.context_parallel_degree,
            ep=p.expert_parallel_degree,
            tp_divisible=dict(tp_divisible or {}),
            dp_impl=p.dp_impl,
            disable_loss_parallel=p.disable_loss_parallel,
        )

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def replica_width(self) -> int:
        """Ranks of one data-parallel replica in one pipeline stage (cp x tp): they train on the same batches."""
        return self.cp * self.tp

    @property
    def world_layout(self) -> WorldLayout:
        """The layout a checkpoint records and a resume compares with."""
        return WorldLayout(self.world_size, self.dp, tp=self.tp, cp=self.cp, ep=self.ep)

    def sequences(self, local_batch: int) -> int:
        """Sequences of one batch over the world: `local_batch` per data-parallel rank (the ranks of a replica
        share them)."""
        return local_batch * self.dp

    def describe_batch(self, local: str, accum: int | None = None) -> str:
        """A batch's split in words: `local` (the sequences of one data-parallel rank, in words) over the
        replicas, and the microbatches a step accumulates: `local 2 x dp 4 x accum 2`."""
        return f"{local} x dp {self.dp}" + (f" x accum {accum}" if accum is not None else "")

    def rank_tokens(self, seq_len: int) -> int:
        """Tokens of each sequence one rank computes (its part under context parallelism)."""
        return seq_len // self.cp

    def describe_sequence(self, seq_len: int) -> str:
        """How a sequence is split over ranks, in words: `seq 8192`, or `seq 8192 / cp 2`."""
        return f"seq {seq_len}" + (f" / cp {self.cp}" if self.cp_enabled else "")

    @property
    def mesh_degrees(self) -> dict[str, int]:
        """Each dim of the world mesh with its degree, outermost first."""
        return {name: getattr(self, name) for name in self.mesh_dim_names}

    @property
    def experts_label(self) -> str:
        """The experts' split in a run's name (`ep2`), empty where experts are not spread."""
        return f"ep{self.ep}" if self.ep_enabled else ""

    def describe_degrees(self) -> str:
        """The degrees in words: `dp_shard 4 x tp 2` (and how the experts are split), or `single rank`."""
        text = " x ".join(f"{n} {d}" for n, d in self.mesh_degrees.items()) or "single rank"
        return text + (f" ({self._experts_text()})" if self.ep_enabled else "")

    def describe(self) -> str:
        """The start-up log's words for the layout: the mesh, the data-parallel plan and its mode, the experts."""
        experts = f"; {self._experts_text()}" if self.ep_enabled else ""
        return f"mesh {self.mesh_degrees} ({self.dp_impl}, {self.dp_mode if self.dp_enabled else 'no dp'}{experts})"

    def _experts_text(self) -> str:
        return f"experts over ep {self.ep} x efsdp {self.efsdp}"

    @property
    def dp_enabled(self) -> bool:
        """Whether the data-parallel plan (SimpleFSDP or FSDP2) is applied: dp x cp > 1, or one process."""
        return self.dp * self.cp > 1 or self.world_size == 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def efsdp(self) -> int:
        """Ranks of dp_shard x cp that hold the same experts (the experts' data-parallel shard degree)."""
        return self.shard_degree // self.ep

    @property
    def loss_parallel(self) -> bool:
        """Logits stay vocab-sharded and the loss runs under `loss_parallel()` (TP only)."""
        return self.tp_enabled and not self.disable_loss_parallel

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def shard_degree(self) -> int:
        """Ranks each parameter is sharded over: dp_shard x cp."""
        return self.dp_shard * self.cp

    @property
    def dp_mode(self) -> str:
        """SimpleFSDP mode implied by the degrees (cp shards like dp_shard)."""
        if self.dp_replicate > 1 and self.shard_degree > 1:
            return "hybrid_shard"
        return "replicate" if self.dp_replicate > 1 else "fully_shard"

    @property
    def dp_dim_names(self) -> tuple[str, ...]:
        """The mesh dims that data parallelism spans (empty without data parallelism)."""
        if self.world_size == 1:
            return ("dp_shard",)
        return tuple(n for n, d in (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard)) if d > 1)

    @property
    def dim_names(self) -> tuple[str, ...]:
        """The dims of one pipeline stage's mesh (every dim but `pp`): what CP, TP and data parallelism use."""
        return self.dp_dim_names + (("cp",) if self.cp > 1 else ()) + (("tp",) if self.tp > 1 else ())

    @property
    def expert_dp_mode(self) -> str:
        """SimpleFSDP mode of the experts over ([dp_replicate,] efsdp): an efsdp of one rank is still a
        (one-rank) shard dim, so the experts gather and cast like every weight."""
        return "hybrid_shard" if self.dp_replicate > 1 else "fully_shard"

    @property
    def expert_param_ndim(self) -> int:
        """The data-parallel dims of `expert_param_mesh` (its leading ones): [dp_replicate,] efsdp."""
        return 1 + int(self.dp_replicate > 1)

    @property
    def param_ndim(self) -> int:
        """The data-parallel dims of `param_mesh` (its leading ones): replicate and/or the shard dim."""
        return max(1, int(self.dp_replicate > 1) + int(self.shard_degree > 1))

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """Every dim of the world mesh, outermost first."""
        return (("pp",) if self.pp > 1 else ()) + self.dim_names

    def build_mesh(self, device_type: str) -> DeviceMesh:
        degrees = {name: getattr(self, name) for name in WORLD_DIMS}
        names = self.mesh_dim_names or ("dp_shard",)
        mesh = init_device_mesh(device_type, tuple(degrees[n] for n in names), mesh_dim_names=names)
        if len(self.dp_dim_names) > 1:
            self._flat_dp = mesh[self.dp_dim_names]._flatten("dp")
        shard = mesh  # dp_shard x cp as one dim, where cp or ep needs it
        if self.cp > 1 or self.ep > 1:
            if self.cp > 1 and self.dp_shard > 1:
                shard = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
            else:
                shard = mesh["cp" if self.cp > 1 else "dp_shard"]
        replicate = [mesh["dp_replicate"]] if self.dp_replicate > 1 else []
        if self.cp > 1:
            parts = [*replicate, shard] + ([mesh["tp"]] if self.tp > 1 else [])
            self._param_mesh = DeviceMesh._concatenate(parts) if len(parts) > 1 else shard
        if self.ep > 1:
            self._expert_mesh = shard._unflatten(0, (self.efsdp, self.ep), ("efsdp", "ep"))
            # Registered so that a reduction over both dims (the experts' gradient norm) is one collective.
            self._expert_mesh._flatten("efsdp_ep")
            self._expert_param_mesh = (
                DeviceMesh._concatenate([*replicate, self._expert_mesh]) if replicate else self._expert_mesh
            )
        self._mesh = mesh
        return mesh

    @property
    def mesh_built(self) -> bool:
        return self._mesh is not None

    @cached_property
    def world_mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("build_mesh() must be called first")
        return self._mesh

    def submesh(self, names: tuple[str, ...]) -> DeviceMesh:
        return self.world_mesh[names[0]] if len(names) == 1 else self.world_mesh[names]

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        """The flattened data-parallel mesh: data loading and loss averaging (None without data dims)."""
        if not self.dp_dim_names:
            return None
        mesh = self.world_mesh
        return self._flat_dp if self._flat_dp is not None else mesh[self.dp_dim_names[0]]

    @property
    def param_mesh(self) -> DeviceMesh:
        """The data-parallel plan's mesh: its `param_ndim` data-parallel dims (dp_shard x cp as one), then tp."""
        if self._param_mesh is not None:
            return self._param_mesh
        return self.submesh(self.dim_names or ("dp_shard",))

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The data-parallel dims of `param_mesh` alone (FSDP2's mesh)."""
        mesh = self.param_mesh
        names = mesh.mesh_dim_names or ()
        return mesh[names[0]] if self.param_ndim == 1 else mesh[names[:2]]

    @property
    def ep_mesh(self) -> DeviceMesh | None:
        """The ranks that split the experts and exchange tokens (None without expert parallelism)."""
        return self._expert_mesh["ep"] if self._expert_mesh is not None else None

    @property
    def efsdp_mesh(self) -> DeviceMesh | None:
        """The ranks of dp_shard x cp that hold the same experts (None without expert parallelism)."""
        return self._expert_mesh["efsdp"] if self._expert_mesh is not None else None

    @property
    def expert_param_mesh(self) -> DeviceMesh | None:
        """The experts' data-parallel plan mesh: their `expert_param_ndim` data-parallel dims, then ep."""
        return self._expert_param_mesh

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh | None:
        """The data-parallel dims of `expert_param_mesh` alone (FSDP2's mesh for the experts)."""
        mesh = self._expert_param_mesh
        if mesh is None:
            return None
        names = mesh.mesh_dim_names or ()
        return mesh[names[0]] if self.expert_param_ndim == 1 else mesh[names[:2]]

    @property
    def cp_mesh(self) -> DeviceMesh | None:
        return self.world_mesh["cp"] if self.cp_enabled else None

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        return self.world_mesh["tp"] if self.tp_enabled else None

    @property
    def pp_mesh(self) -> DeviceMesh | None:
        return self.world_mesh["pp"] if self.pp_enabled else None

    @property
    def loss_meshes(self) -> tuple[DeviceMesh, ...]:
        """The meshes a rank's mean loss is averaged over to give the batch's: the data-parallel replicas
        and, under context parallelism, each sequence's equal parts."""
        return tuple(m for m in (self.dp_mesh, self.cp_mesh) if m is not None)

    def process_groups(self) -> dict[str, dist.ProcessGroup]:
        """Every process group of the mesh by dim name (and the flattened `dp`): what a collective can run on."""
        mesh = self.world_mesh
        groups = {name: mesh[name].get_group() for name in mesh.mesh_dim_names or ()}
        if self._flat_dp is not None:
            groups["dp"] = self._flat_dp.get_group()
        if self._param_mesh is not None and self.dp_shard > 1:
            groups["dp_shard_cp"] = self.fsdp_mesh.get_group(self.param_ndim - 1)
        return groups

    def dp_rank_of(self, rank: int) -> int:
        """Global `rank`'s index on the flattened dp mesh (ranks are laid out pp, dp_replicate, dp_shard,
        cp, tp); arithmetic only, so it is known before any process group exists."""
        return (rank // self.replica_width) % self.dp

    def cp_rank_of(self, rank: int) -> int:
        """Global `rank`'s context-parallel rank: which two chunks of every sequence it holds."""
        return (rank // self.tp) % self.cp

    def pp_rank_of(self, rank: int) -> int:
        """Global `rank`'s pipeline rank (0 holds the first stage)."""
        return rank // self._stage_ranks

    def pipeline_peers(self, rank: int) -> list[int]:
        """The global rank of each pipeline rank (by index) that has global `rank`'s other coordinates:
        `[rank]` without pipeline parallelism."""
        return [rank % self._stage_ranks + p * self._stage_ranks for p in range(self.pp)]

    @property
    def _stage_ranks(self) -> int:
        """Ranks of one pipeline rank (dp x cp x tp)."""
        return self.dp * self.replica_width
