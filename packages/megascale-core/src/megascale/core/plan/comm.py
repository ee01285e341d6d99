"""Time of the collectives a layout issues, on a ``ClusterSpec``: ring algorithms over NVLink and the network.

Ranks are placed as ``ParallelDims`` builds its ("dp", "pp", "tp") mesh: tp innermost, so a tensor-parallel
group is consecutive ranks (one node while tp ≤ GPUs per node), pipeline neighbours are tp ranks apart and
data-parallel peers tp·pp apart. A group with k members on each of n nodes runs a collective hierarchically,
as NCCL's rings do on a rail-connected cluster: an all-reduce of S bytes moves 2(k-1)/k·S over NVLink and
2(n-1)/n·S/k over each member's own network adapter (Patarasuk & Yuan 2009 for the ring's bandwidth
optimality); all-gather and reduce-scatter move half of it. Latency terms are left out: the messages here are
megabytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from megascale.core.plan.cluster import ClusterSpec

__all__ = ["Group", "all_reduce_time", "gather_time", "p2p_time"]


@dataclass(frozen=True)
class Group:
    """A process group: ``per_node`` members on each of ``nodes`` nodes."""

    per_node: int
    nodes: int

    @property
    def size(self) -> int:
        return self.per_node * self.nodes

    @classmethod
    def of(cls, size: int, stride: int, gpus_per_node: int) -> Group:
        """The group of ``size`` ranks ``stride`` apart (tp: 1, pp: tp, dp: tp·pp)."""
        if size <= 1:
            return cls(1, 1)
        per_node = max(1, min(size, gpus_per_node // stride)) if stride < gpus_per_node else 1
        return cls(per_node, -(-size // per_node))


def all_reduce_time(nbytes: float, group: Group, cluster: ClusterSpec) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` (each member's buffer) over ``group``."""
    return 2 * gather_time(nbytes, group, cluster)


def gather_time(nbytes: float, group: Group, cluster: ClusterSpec) -> float:
    """Seconds of a ring all-gather (or reduce-scatter) whose whole buffer is ``nbytes``."""
    if group.size <= 1:
        return 0.0
    g = cluster.gpu
    k, n = group.per_node, group.nodes
    intra = (k - 1) / k * nbytes / (g.nvlink_bandwidth * g.link_efficiency)
    inter = (n - 1) / n * (nbytes / k) / (cluster.network_bandwidth_per_gpu * g.link_efficiency)
    return intra + inter


def p2p_time(nbytes: float, across_nodes: bool, cluster: ClusterSpec) -> float:
    """Seconds to send ``nbytes`` from one GPU to another (over its adapter when ``across_nodes``)."""
    g = cluster.gpu
    bw = cluster.network_bandwidth_per_gpu if across_nodes else g.nvlink_bandwidth
    return nbytes / (bw * g.link_efficiency)
