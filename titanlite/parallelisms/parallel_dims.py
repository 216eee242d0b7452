"""Parallel degrees -> one validated DeviceMesh with named dims.

The mesh holds only the dims whose degree is > 1, in the order (dp_replicate, dp_shard, tp), so that tp
ranks are neighbours (NVLink within a node) and data parallelism spans nodes. Flattened views:
`dp` (every data-parallel dim: the ranks that see different data, the dataloader's and the loss's mesh)
and `dp_shard_tp`-style submeshes are taken with torch's own slicing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titanlite.errors import ConfigError


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    n_heads: int | None = None
    n_kv_heads: int | None = None
    dp_impl: str = "simple_fsdp"
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.dp_shard == -1:
            rest = self.dp_replicate * self.tp
            if self.world_size % rest:
                raise ConfigError(
                    f"parallelism: world size {self.world_size} is not divisible by "
                    f"data_parallel_replicate_degree {self.dp_replicate} x tensor_parallel_degree {self.tp}"
                )
            self.dp_shard = self.world_size // rest
        product = self.dp_replicate * self.dp_shard * self.tp
        if product != self.world_size:
            raise ConfigError(
                f"parallelism: mesh dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x tp={self.tp} "
                f"= {product} does not equal the world size {self.world_size}"
            )
        for name, heads in (("n_heads", self.n_heads), ("n_kv_heads", self.n_kv_heads)):
            if heads is not None and heads % self.tp:
                raise ConfigError(f"parallelism: tensor_parallel_degree {self.tp} does not divide the model's {name} {heads}")
        if self.dp_impl == "fsdp2" and self.dp_replicate > 1 and self.dp_shard == 1:
            raise ConfigError(
                "parallelism: dp_impl=fsdp2 needs data_parallel_shard_degree > 1 "
                f"(got dp_replicate={self.dp_replicate} x dp_shard=1); use dp_impl=simple_fsdp for pure replication"
            )

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def dp_mode(self) -> str:
        """SimpleFSDP mode implied by the degrees."""
        if self.dp_replicate > 1 and self.dp_shard > 1:
            return "hybrid_shard"
        return "replicate" if self.dp_replicate > 1 else "fully_shard"

    @property
    def dp_dim_names(self) -> tuple[str, ...]:
        """The mesh dims that data parallelism spans (empty without data parallelism)."""
        return tuple(n for n, d in (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard)) if d > 1)

    @property
    def dim_names(self) -> tuple[str, ...]:
        return self.dp_dim_names + (("tp",) if self.tp > 1 else ())

    def build_mesh(self, device_type: str) -> DeviceMesh:
        degrees = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp}
        names = self.dim_names or ("dp_shard",)
        mesh = init_device_mesh(device_type, tuple(degrees[n] for n in names), mesh_dim_names=names)
        if len(self.dp_dim_names) > 1:
            mesh[self.dp_dim_names]._flatten("dp")
        self._mesh = mesh
        return mesh

    @cached_property
    def world_mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("build_mesh() must be called first")
        return self._mesh

    def submesh(self, names: tuple[str, ...]) -> DeviceMesh:
        return self.world_mesh[names[0]] if len(names) == 1 else self.world_mesh[names]

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        """The flattened data-parallel mesh: data loading and loss averaging."""
        if not self.dp_enabled:
            return None
        return self.world_mesh["dp"] if len(self.dp_dim_names) > 1 else self.world_mesh[self.dp_dim_names[0]]

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        return self.world_mesh["tp"] if self.tp_enabled else None

    def dp_rank(self) -> int:
        mesh = self.dp_mesh
        return mesh.get_local_rank() if mesh is not None else 0
