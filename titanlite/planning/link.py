"""Collective times over one mesh dim's group of ranks: NVLink within a node, the network across nodes,
for the step-time model (`step_time.py`) and its data-parallel term (`data_parallel_time.py`)."""

from __future__ import annotations

from titanlite.planning.gpus import COLLECTIVE_EFFICIENCY, GpuKind


class Link:
    """Collective times over one mesh dim's group of `size` ranks, `per_node` of them on each node.

    Within a node: NVLink. Across nodes NCCL runs one ring per NIC, so a group with k members per node
    crosses the network through k NICs at once: min(NVLink, k x network) per GPU (nccl-tests' multi-node
    bus bandwidth on 8-GPU nodes with a NIC per GPU is about eight times one NIC's)."""

    def __init__(self, kind: GpuKind, size: int, per_node: int):
        self.size, self.per_node = size, per_node
        self.nvlink_bytes_per_s = kind.nvlink_gbps * 1e9 * COLLECTIVE_EFFICIENCY
        self.network_bytes_per_s = kind.network_gbps * 1e9 * COLLECTIVE_EFFICIENCY
        inter = size > per_node
        bw = min(kind.nvlink_gbps, per_node * kind.network_gbps) if inter else kind.nvlink_gbps
        self.bytes_per_s = bw * 1e9 * COLLECTIVE_EFFICIENCY
        self.latency = kind.inter_latency_s if inter else kind.intra_latency_s

    @classmethod
    def of(cls, kind: GpuKind, size: int, stride: int) -> Link:
        """The group of `size` ranks `stride` apart (ranks fill nodes of `kind.gpus_per_node` in order)."""
        return cls(kind, size, max(1, min(size, kind.gpus_per_node // stride)))

    def ring(self, nbytes: float, all_reduce: bool = False) -> float:
        """An all-gather or reduce-scatter of `nbytes` unsharded bytes (an all-reduce: twice the traffic)."""
        if self.size == 1 or nbytes == 0:
            return 0.0
        share = (self.size - 1) / self.size * (2 if all_reduce else 1)
        return share * nbytes / self.bytes_per_s + self.latency

    def all_to_all(self, nbytes: float) -> float:
        """An all-to-all in which each rank holds `nbytes` to spread evenly over the group (it keeps its own
        share): the shares for ranks on its node cross NVLink, the others its own NIC, both at once. No
        ring spreads the network part over the node's NICs, so it is slower than a ring of the same bytes."""
        if self.size == 1 or nbytes == 0:
            return 0.0
        local = (self.per_node - 1) / self.size * nbytes / self.nvlink_bytes_per_s
        remote = (self.size - self.per_node) / self.size * nbytes / self.network_bytes_per_s
        return max(local, remote) + self.latency

    def send(self, nbytes: float) -> float:
        return 0.0 if self.size == 1 else nbytes / self.bytes_per_s + self.latency

    def linear(self, bytes_per_elem: float, all_reduce: bool = False) -> tuple[float, float]:
        """(seconds per element, latency) of `ring` on a unit of elements of `bytes_per_elem` bytes."""
        if self.size == 1:
            return 0.0, 0.0
        share = (self.size - 1) / self.size * (2 if all_reduce else 1)
        return share * bytes_per_elem / self.bytes_per_s, self.latency
