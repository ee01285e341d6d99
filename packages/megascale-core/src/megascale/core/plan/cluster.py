"""Cluster specs: the GPU kinds the planner ships, what each kind of kernel achieves on them, and a cluster.

Peak figures are the vendors' datasheet numbers (dense bf16/fp16 tensor-core FLOP/s, HBM capacity and
bandwidth, NVLink bandwidth per direction) and the network of their reference systems (DGX A100: eight 200 Gb/s
HDR InfiniBand adapters per node; DGX H100/H200: eight 400 Gb/s NDR). What a training step achieves of them is
a table of kernel rates per GPU kind (``KernelRates``, ``rates.py``: each figure with its source):

- ``matmul_efficiency``: the fraction of peak FLOP/s a transformer's GEMMs sustain. Fitted: on A100 to the
  whole Megatron-LM 2021 table (``benchmarks/plan_megatron.py``; Narayanan et al. 2021, arXiv 2104.04473,
  Table 1); on H200 to the training steps measured on one H200 (``data/h200_2026_11_26.csv``), the one
  constant fitted there; H100 (the same GH100 chip and clocks) takes the H200's. ``calibrate.py`` measures it
  on this machine.
- memory-bound kernels (norms, activation, rotary, cross-entropy, residual adds and casts, the optimizer): a
  fraction of HBM bandwidth forward and the backward's time as a multiple of the forward's, measured per
  kernel on the H200 (``benchmarks/kernel_bench.py``), the same fractions of the H100's bandwidth; on A100 one
  fraction (0.85) for all, backward twice the forward, the calibration that holds on Megatron's table.
- fused attention: useful FLOP/s forward and backward as fractions of peak, measured on the H200 (SDPA
  causal; FlexAttention for a sliding window).
- ``mfu_cap``: no layout is predicted above the best model-FLOP utilisation measured on the kind
  (``StepEstimate.mfu``'s count): on A100 Megatron-LM's published MFU by model size (22B 41.5% to 1T 56.3%),
  on H200/H100 the best step measured on the H200.
- ``link_efficiency``: the fraction of link bandwidth NCCL's ring collectives reach as bus bandwidth (0.8,
  nccl-tests' typical busbw over NVLink and InfiniBand).

Every collective call also pays a latency (the alpha of t = alpha + bytes / bandwidth; ``comm.py`` counts the
calls as the runtime issues them). On GPU clusters it is NCCL's own cost model for its ring algorithm with the
Simple protocol, the one large messages take (NVIDIA/nccl ``src/graph/tuning.cc``: ``baseLat`` 8.4 µs per
call, ``hwLat`` 3.4 µs per ring step over NVLink and 9.6 µs per step over the network), the same for the three
kinds (NCCL's table does not tell A100 from H100). A point-to-point transfer is taken as one call of one step.
On this machine ``calibrate.py`` measures them (a small gloo all-reduce, a gloo send/receive).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megascale.core.plan.rates import A100_MATMUL_EFFICIENCY, A100_RATES, H100_RATES, H200_RATES, KernelRates

__all__ = ["A100_80GB", "GPUS", "H100_SXM", "H200", "MATMUL_EFFICIENCY", "ClusterSpec", "GPUSpec", "gpu_spec"]

#: the A100 calibration: fraction of peak FLOP/s the GEMMs of a training step reach (fitted on the Megatron
#: table); the default of a ``GPUSpec`` without a kernel-rate table
MATMUL_EFFICIENCY = A100_MATMUL_EFFICIENCY

# NCCL's latency model, ring algorithm, Simple protocol (NVIDIA/nccl src/graph/tuning.cc: baseLat, hwLat)
NCCL_CALL_LATENCY = 8.4e-6  # seconds per collective call
NVLINK_STEP_LATENCY = 3.4e-6  # seconds per ring step between GPUs of a node
NETWORK_STEP_LATENCY = 9.6e-6  # seconds per ring step between nodes (InfiniBand / RoCE)

_G = 1e9
_T = 1e12


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator kind.

    Args:
        name: how it is called on the command line (``--gpu``).
        peak_flops: dense bf16/fp16 FLOP/s (or the measured matmul rate of a CPU, see ``calibrate``).
        memory_bytes: device memory.
        memory_bandwidth: device-memory bytes/s.
        nvlink_bandwidth: bytes/s one GPU sends to its node's peers at once (NVLink, per direction).
        matmul_efficiency: fraction of ``peak_flops`` sustained by the GEMMs (overrides ``rates``' figure).
        memory_efficiency: fraction of ``memory_bandwidth`` sustained by every memory-bound kernel when
            ``rates`` is None.
        link_efficiency: fraction of a link's bandwidth a collective reaches.
        call_latency: seconds every collective call costs whatever its size (NCCL's base latency).
        nvlink_latency: seconds per ring step between GPUs of one node.
        p2p_latency: seconds of a point-to-point transfer inside a node beyond its bytes; None: one call of
            one NVLink step.
        overlap: whether communication issued asynchronously runs beside compute (GPUs: NCCL kernels on their
            own SMs). False for CPU ranks: gloo moves the bytes on the cores the ranks compute on, so nothing
            is hidden (``calibrate.cpu_cluster``).
        rates: the kind's kernel-rate table (``rates.py``); None: ``KernelRates.uniform`` of the two
            efficiencies above, with no MFU cap.
    """

    name: str
    peak_flops: float
    memory_bytes: float
    memory_bandwidth: float
    nvlink_bandwidth: float
    matmul_efficiency: float = MATMUL_EFFICIENCY
    memory_efficiency: float = 0.85
    link_efficiency: float = 0.8
    call_latency: float = NCCL_CALL_LATENCY
    nvlink_latency: float = NVLINK_STEP_LATENCY
    p2p_latency: float | None = None
    overlap: bool = True
    rates: KernelRates | None = None

    @property
    def kernel_rates(self) -> KernelRates:
        """The kernel-rate table the throughput model uses, with this spec's ``matmul_efficiency``."""
        if self.rates is None:
            return KernelRates.uniform(
                f"{self.name}, uniform", self.matmul_efficiency, self.memory_efficiency,
                sources=(("all", "this GPUSpec's matmul_efficiency and memory_efficiency"),),
            )  # fmt: skip
        if self.rates.matmul_efficiency == self.matmul_efficiency:
            return self.rates
        return replace(self.rates, matmul_efficiency=self.matmul_efficiency)


A100_80GB = GPUSpec("a100-80gb", peak_flops=312 * _T, memory_bytes=80 * _G, memory_bandwidth=2039 * _G,
                    nvlink_bandwidth=300 * _G, matmul_efficiency=A100_RATES.matmul_efficiency, rates=A100_RATES)  # fmt: skip
H100_SXM = GPUSpec("h100-sxm", peak_flops=989 * _T, memory_bytes=80 * _G, memory_bandwidth=3350 * _G,
                   nvlink_bandwidth=450 * _G, matmul_efficiency=H100_RATES.matmul_efficiency, rates=H100_RATES)  # fmt: skip
H200 = GPUSpec("h200", peak_flops=989 * _T, memory_bytes=141 * _G, memory_bandwidth=4800 * _G,
               nvlink_bandwidth=450 * _G, matmul_efficiency=H200_RATES.matmul_efficiency, rates=H200_RATES)  # fmt: skip
GPUS: dict[str, GPUSpec] = {g.name: g for g in (A100_80GB, H100_SXM, H200)}
_ALIASES = {"a100": "a100-80gb", "h100": "h100-sxm", "h200-sxm": "h200"}
_NETWORK = {"a100-80gb": 8 * 25 * _G, "h100-sxm": 8 * 50 * _G, "h200": 8 * 50 * _G}  # bytes/s per node


def gpu_spec(name: str) -> GPUSpec:
    """The shipped spec called ``name`` (or an alias: a100, h100)."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in GPUS:
        raise ValueError(f"unknown GPU kind {name!r}; known: {sorted(GPUS)} (aliases {sorted(_ALIASES)})")
    return GPUS[key]


@dataclass(frozen=True)
class ClusterSpec:
    """GPUs of one kind, ``gpus_per_node`` to a node joined by NVLink, nodes joined by a network.

    Args:
        gpu: the accelerator.
        gpus: how many in all.
        gpus_per_node: GPUs sharing a node's NVLink.
        network_bandwidth: bytes/s a node sends to the network at once (all its adapters, per direction);
            None: the reference system's for ``gpu`` (8 adapters of 200 Gb/s for A100, 400 Gb/s for H100/H200).
        usable_memory_fraction: what a layout may use of each GPU's memory; the rest is left to the CUDA
            context, NCCL's buffers and the caching allocator's fragmentation.
        network_latency: seconds per ring step between nodes (NCCL's model for InfiniBand; module docstring).
    """

    gpu: GPUSpec
    gpus: int
    gpus_per_node: int = 8
    network_bandwidth: float | None = None
    usable_memory_fraction: float = 0.9
    network_latency: float = NETWORK_STEP_LATENCY

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(f"gpus={self.gpus} and gpus_per_node={self.gpus_per_node} must be >= 1")
        if self.network_bandwidth is None:
            object.__setattr__(
                self, "network_bandwidth", _NETWORK.get(self.gpu.name, self.gpu.nvlink_bandwidth)
            )

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    @property
    def usable_memory(self) -> float:
        return self.gpu.memory_bytes * self.usable_memory_fraction

    @property
    def network_bandwidth_per_gpu(self) -> float:
        """A node's network bandwidth shared by its GPUs (each drives its own adapter in a rail layout)."""
        assert self.network_bandwidth is not None
        return self.network_bandwidth / self.gpus_per_node

    def with_gpu(self, **changes: float) -> ClusterSpec:
        """This cluster with fields of its GPU spec changed (e.g. a calibrated efficiency)."""
        return replace(self, gpu=replace(self.gpu, **changes))  # type: ignore[arg-type]
