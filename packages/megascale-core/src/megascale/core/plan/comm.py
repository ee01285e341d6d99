"""Time of the collectives a layout issues, on a ``ClusterSpec``: ring algorithms over NVLink and the network.

Ranks are placed as ``ParallelDims`` builds its ("dp", "pp", "tp") mesh: tp innermost, so a tensor-parallel
group is consecutive ranks (one node while tp ≤ GPUs per node), pipeline neighbours are tp ranks apart and
data-parallel peers tp·pp apart. A group with k members on each of n nodes runs a collective hierarchically,
as NCCL's rings do on a rail-connected cluster: an all-reduce of S bytes moves 2(k-1)/k·S over NVLink and
2(n-1)/n·S/k over each member's own network adapter (Patarasuk & Yuan 2009 for the ring's bandwidth
optimality); all-gather and reduce-scatter move half of it.

Each call also pays a latency, alpha in t = alpha + bytes / bandwidth, as NCCL's tuning model has it for a ring
(``cluster.py``): the call's own latency plus one per ring step, 2(kn-1) steps for an all-reduce of which 2(n-1)
cross nodes, half of that for an all-gather or reduce-scatter. ``calls`` says into how many collectives the
runtime splits the bytes (chunks overlapped with GEMMs, gradient buckets): the bandwidth term is the same, the
latency is paid per call. Large messages hardly notice it; dozens of small ones per layer (tensor-parallel
chunks on a CPU) do.
"""

from __future__ import annotations

from dataclasses import dataclass

from megascale.core.plan.cluster import ClusterSpec

__all__ = [
    "Group",
    "all_reduce_time",
    "all_to_all_time",
    "call_latency",
    "gather_time",
    "p2p_latency",
    "p2p_time",
]


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


def call_latency(group: Group, cluster: ClusterSpec, all_reduce: bool = False) -> float:
    """Seconds one collective call over ``group`` costs beyond its bytes (an all-gather / reduce-scatter, or
    with ``all_reduce`` an all-reduce: twice the ring steps)."""
    if group.size <= 1:
        return 0.0
    k, n = group.per_node, group.nodes
    steps, inter = k * n - 1, n - 1
    if all_reduce:
        steps, inter = 2 * steps, 2 * inter
    g = cluster.gpu
    return g.call_latency + (steps - inter) * g.nvlink_latency + inter * cluster.network_latency


def all_reduce_time(nbytes: float, group: Group, cluster: ClusterSpec, calls: int = 1) -> float:
    """Seconds of ring all-reduces of ``nbytes`` in all (each member's buffer), split into ``calls`` calls."""
    if group.size <= 1:
        return 0.0
    return 2 * _gather_bytes_time(nbytes, group, cluster) + calls * call_latency(group, cluster, True)


def gather_time(nbytes: float, group: Group, cluster: ClusterSpec, calls: int = 1) -> float:
    """Seconds of ring all-gathers (or reduce-scatters) whose whole buffers hold ``nbytes`` in all, split into
    ``calls`` calls."""
    if group.size <= 1:
        return 0.0
    return _gather_bytes_time(nbytes, group, cluster) + calls * call_latency(group, cluster)


def _gather_bytes_time(nbytes: float, group: Group, cluster: ClusterSpec) -> float:
    """The bandwidth term of an all-gather of ``nbytes``: hierarchical ring over NVLink, then the adapters."""
    g = cluster.gpu
    k, n = group.per_node, group.nodes
    intra = (k - 1) / k * nbytes / (g.nvlink_bandwidth * g.link_efficiency)
    inter = (n - 1) / n * (nbytes / k) / (cluster.network_bandwidth_per_gpu * g.link_efficiency)
    return intra + inter


def all_to_all_time(nbytes: float, group: Group, cluster: ClusterSpec, calls: int = 1) -> float:
    """Seconds of all-to-alls in which each member sends ``nbytes`` in all, an equal part to every member (its
    own part stays): (k - 1)/size of it over NVLink to its node's peers, (size - k)/size over its adapter to the
    other nodes' (the two at once: the slower decides); each call pays the call's and one network step's
    latency (NCCL posts every peer's send at once)."""
    if group.size <= 1:
        return 0.0
    g, k, size = cluster.gpu, group.per_node, group.size
    intra = (k - 1) / size * nbytes / (g.nvlink_bandwidth * g.link_efficiency)
    inter = (size - k) / size * nbytes / (cluster.network_bandwidth_per_gpu * g.link_efficiency)
    latency = g.call_latency + (cluster.network_latency if group.nodes > 1 else g.nvlink_latency)
    return max(intra, inter) + calls * latency


def p2p_latency(across_nodes: bool, cluster: ClusterSpec) -> float:
    """Seconds a point-to-point transfer costs beyond its bytes: the GPU kind's (or measured) figure, or one
    call of one ring step; crossing nodes adds a network step."""
    g = cluster.gpu
    base = g.p2p_latency if g.p2p_latency is not None else g.call_latency + g.nvlink_latency
    return base + (cluster.network_latency if across_nodes else 0.0)


def p2p_time(nbytes: float, across_nodes: bool, cluster: ClusterSpec) -> float:
    """Seconds to send ``nbytes`` from one GPU to another (over its adapter when ``across_nodes``)."""
    g = cluster.gpu
    bw = cluster.network_bandwidth_per_gpu if across_nodes else g.nvlink_bandwidth
    return p2p_latency(across_nodes, cluster) + nbytes / (bw * g.link_efficiency)
