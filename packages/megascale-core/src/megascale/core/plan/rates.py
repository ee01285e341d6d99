"""Kernel rates: what each kind of kernel of a training step achieves on a GPU kind, and where each figure
comes from.

``throughput.py`` times a step kernel by kernel: GEMMs at ``matmul_efficiency`` of peak, fused attention at its
own useful FLOP/s, each memory-bound kernel at its own fraction of HBM bandwidth (and its backward at its own
multiple of the forward's time), the optimizer at its fraction of HBM bandwidth. A step is then bounded by
``mfu_cap``: no layout is predicted above the best model-FLOP utilisation measured on the kind.

Sources (``KernelRates.sources`` carries them with the figures; ``megascale plan`` prints the table's name):

- H200: one NVIDIA H200 on 2026-11-26 (torch 2.11, triton 3.6; ``/work/shared/data/gpu-h200-2026-11-26.md``):
  ``benchmarks/kernel_bench.py`` per kernel (GB/s of the bytes the fused kernel must move, forward and
  forward + backward; attention in useful TFLOP/s, backward counted 2.5x the forward's FLOPs), the HBM figure
  4.8 TB/s with a device-to-device copy at ~4.3 TB/s (residual adds, casts, the optimizer), and the matmul
  efficiency fitted to the four megascale training steps measured there (``data/h200_2026_11_26.csv``;
  ``published.fit_matmul_efficiency``).
- H100-SXM: the H200's rates scaled by the datasheets: the same GH100 chip and clocks (989 TFLOP/s dense bf16
  both), so GEMMs and attention reach the same fractions of the same peak; HBM3 3.35 TB/s against HBM3e
  4.8 TB/s, so every memory-bound kernel takes 4.8 / 3.35 = 1.43x the H200's time at the same fraction. Not
  measured on an H100 here.
- A100-80GB: the calibration that holds on Megatron-LM 2021's table (``benchmarks/plan_megatron.py``): GEMMs at
  0.70 of 312 TFLOP/s (the table's least-squares fit), every memory-bound kernel at 0.85 of 2.04 TB/s with the
  backward twice the forward; fused attention (not in that table) at the H200's measured fractions of peak,
  which put forward + backward at 51% of peak, the low end of FlashAttention-2's published 50-73% on A100
  (Dao 2023, arXiv 2307.08691).

Caps (model FLOPs as ``StepEstimate.mfu`` counts them: ``flops_per_token``, causal attention halved):

- A100: by model size, the best MFU Megatron-LM published on A100 with selective recomputation and sequence
  parallelism (Korthikanti et al. 2022, arXiv 2205.05198; the Megatron-LM README's table, dp 1): 22B 41.5%,
  175B 51.4%, 530B 56.0%, 1T 56.3%, i.e. 40.4%, 50.7%, 55.5%, 55.9% by this count (theirs does not halve causal
  attention); interpolated in log(parameters) between them, 40.4% below 22B and 55.9% above 1T. MegaScale's
  55.2% at 12,288 A100s (Jiang et al. 2024, arXiv 2402.15627) is within it. Below 22B no Megatron measurement
  exists: the cap there is the 22B one (FlashAttention-2 reports more for 1.3-2.7B models on one 8-GPU node
  by a count that does not halve causal attention; not checked here).
- H200 and H100: 0.523, the best step measured on the H200 by this count (Llama-3-8B's layers, d 4096, 8 of
  them, 2.80B: 36,871 tokens/s; 53.8% by torchtitan's count, which does not halve causal attention and so
  ranks the d 3072 step first at 54.5%, 51.7% here); the H100 cannot do better with less bandwidth.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

__all__ = [
    "A100_RATES",
    "H100_RATES",
    "H200_RATES",
    "MEMORY_BOUND",
    "AttentionRate",
    "KernelRate",
    "KernelRates",
]


MEMORY_BOUND = (
    "rms_norm",
    "layer_norm",
    "swiglu",
    "gelu",
    "rope",
    "cross_entropy",
    "elementwise",
    "optimizer",
)
"""The memory-bound kernel kinds of a ``KernelRates`` table (its fields of those names)."""


@dataclass(frozen=True)
class KernelRate:
    """A memory-bound kernel: forward at ``fraction`` of HBM bandwidth over the bytes it moves, backward taking
    ``backward`` times the forward's time."""

    fraction: float
    backward: float = 2.0


@dataclass(frozen=True)
class AttentionRate:
    """A fused attention kernel: useful FLOP/s as fractions of peak, forward (4·hd FLOPs per (query, key) pair
    and head) and backward (counted 2.5x the forward's FLOPs, as ``benchmarks/kernel_bench.py`` counts them)."""

    forward: float
    backward: float


@dataclass(frozen=True)
class KernelRates:
    """What the kernels of a training step achieve on one GPU kind (module docstring), and the sources.

    Args:
        name: the table's name (the GPU kind and where it was measured).
        matmul_efficiency: fraction of peak FLOP/s the GEMMs sustain.
        rms_norm, layer_norm, swiglu, gelu, rope, cross_entropy: the fused kernels.
        elementwise: residual adds, dropout, casts, the softmax of unfused attention, the embedding's gather.
        optimizer: the fused optimizer step (its ``backward`` is unused).
        attention: fused causal attention (flash-attn / SDPA); None: its FLOPs at the GEMM rate, the backward
            twice the forward's.
        window_attention: fused attention over a sliding window; None: as ``attention``.
        mfu_cap: the best model-FLOP utilisation measured on the kind: no step is predicted faster; None: no cap.
        mfu_cap_by_size: (parameters, MFU) of the best measured at some sizes, ascending: the cap of a model
            between two is interpolated in log(parameters), outside them the nearest one's; empty: ``mfu_cap``.
        sources: (what, where it comes from) for every figure above.
    """

    name: str
    matmul_efficiency: float
    rms_norm: KernelRate
    layer_norm: KernelRate
    swiglu: KernelRate
    gelu: KernelRate
    rope: KernelRate
    cross_entropy: KernelRate
    elementwise: KernelRate
    optimizer: KernelRate
    attention: AttentionRate | None = None
    window_attention: AttentionRate | None = None
    mfu_cap: float | None = None
    mfu_cap_by_size: tuple[tuple[float, float], ...] = ()
    sources: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    def cap(self, parameters: float) -> float | None:
        """The MFU no layout of a model of ``parameters`` is predicted above (``mfu_cap_by_size``)."""
        points = self.mfu_cap_by_size
        if not points:
            return self.mfu_cap
        if parameters <= points[0][0]:
            return points[0][1]
        for (p0, c0), (p1, c1) in itertools.pairwise(points):
            if parameters <= p1:
                x = math.log(parameters / p0) / math.log(p1 / p0)
                return c0 + x * (c1 - c0)
        return points[-1][1]

    @classmethod
    def uniform(
        cls, name: str, matmul_efficiency: float, memory_efficiency: float, mfu_cap: float | None = None,
        sources: tuple[tuple[str, str], ...] = (),
    ) -> KernelRates:  # fmt: skip
        """Every memory-bound kernel at one fraction of HBM bandwidth, backward twice the forward; attention at
        the GEMM rate (the model before per-kernel rates, and ``calibrate``'s CPU ranks)."""
        one = KernelRate(memory_efficiency)
        return cls(name, matmul_efficiency, one, one, one, one, one, one, one, one, mfu_cap=mfu_cap,
                   sources=sources)  # fmt: skip

    def to_dict(self) -> dict[str, object]:
        """The figures and their sources, for ``megascale plan --json``."""
        out: dict[str, object] = {"name": self.name, "matmul_efficiency": self.matmul_efficiency}
        for kind in MEMORY_BOUND:
            rate: KernelRate = getattr(self, kind)
            out[kind] = {"hbm_fraction": rate.fraction, "backward_over_forward": rate.backward}
        for kind in ("attention", "window_attention"):
            att: AttentionRate | None = getattr(self, kind)
            out[kind] = (
                None if att is None else {"forward_of_peak": att.forward, "backward_of_peak": att.backward}
            )
        out["mfu_cap"] = self.mfu_cap
        out["mfu_cap_by_size"] = [list(p) for p in self.mfu_cap_by_size]
        out["sources"] = dict(self.sources)
        return out


# ---- H200: measured (module docstring) -------------------------------------------------------------------------

H200_HBM_GBPS = 4800.0
"""HBM3e bandwidth of the H200 (datasheet), the unit of its memory-bound fractions."""


def _measured(gbps_fwd: float, ms_fwd: float, ms_fwd_bwd: float) -> KernelRate:
    """A kernel from ``benchmarks/kernel_bench.py``'s H200 row: forward GB/s, forward and forward+backward times."""
    return KernelRate(gbps_fwd / H200_HBM_GBPS, (ms_fwd_bwd - ms_fwd) / ms_fwd)


def _attention(
    tflops_fwd: float, ms_fwd: float, ms_fwd_bwd: float, peak_tflops: float = 989.0
) -> AttentionRate:
    """Attention from its H200 row: useful forward TFLOP/s, forward and forward+backward times."""
    flops = tflops_fwd * 1e12 * ms_fwd * 1e-3  # the forward's useful FLOPs
    backward = 2.5 * flops / ((ms_fwd_bwd - ms_fwd) * 1e-3) / 1e12
    return AttentionRate(tflops_fwd / peak_tflops, backward / peak_tflops)


H200_MATMUL_EFFICIENCY = 0.616
"""Fraction of 989 TFLOP/s the GEMMs reach on the H200: the least-squares fit over the four megascale training
steps measured there (``published.fit_matmul_efficiency(published.h200_steps())``)."""

H200_MFU_CAP = 0.523
"""The best step measured on the H200, by ``StepEstimate.mfu``'s count (``published.best_measured_mfu``)."""

_H200_FILE = "gpu-h200-2026-11-26.md (one H200, torch 2.11, triton 3.6), benchmarks/kernel_bench.py"

H200_RATES = KernelRates(
    name="h200, measured 2026-11-26",
    matmul_efficiency=H200_MATMUL_EFFICIENCY,
    rms_norm=_measured(3860, 0.070, 0.255),  # 16384 x 4096 bf16, Triton
    layer_norm=_measured(2870, 0.094, 0.608),
    swiglu=_measured(4260, 0.378, 1.027),  # 16384 x 16384
    gelu=_measured(3540, 0.303, 1.094),  # bias_gelu
    rope=_measured(3730, 0.072, 0.202),  # B4 T4096 H32 hd128
    cross_entropy=_measured(2220, 1.891, 3.997),  # 16384 x 128256
    elementwise=KernelRate(4300 / H200_HBM_GBPS),  # a device-to-device copy, read + write
    optimizer=KernelRate(4300 / H200_HBM_GBPS),
    attention=_attention(590, 0.466, 1.920),  # SDPA causal, B2 T4096 H32/8 hd128
    window_attention=_attention(302, 0.399, 1.643),  # FlexAttention, window 1024, block mask
    mfu_cap=H200_MFU_CAP,
    sources=(
        ("matmul_efficiency", "fitted to the 4 megascale steps measured on one H200 (data/h200_2026_11_26.csv)"),
        ("memory-bound kernels", f"{_H200_FILE}: fused GB/s forward of 4.8 TB/s, backward/forward time"),
        ("elementwise, optimizer", "a device-to-device copy on the H200, ~4.3 of 4.8 TB/s (not the optimizer itself)"),
        ("attention", f"{_H200_FILE}: SDPA causal 590 / 473 TFLOP/s forward / backward, hd 128"),
        ("window_attention", f"{_H200_FILE}: FlexAttention window 1024, 302 / 242 TFLOP/s"),
        ("mfu_cap", "the best step measured on the H200: d4096 x 8 layers 2.80B, 36,871 tok/s (53.8% torchtitan's count)"),
    ),
)  # fmt: skip

H100_RATES = replace(  # every fraction the H200's (see sources); only the name and the sources differ
    H200_RATES,
    name="h100-sxm, scaled from the h200 measurement",
    sources=(
        ("matmul_efficiency, attention", "the H200's fractions of peak: the same GH100 chip, clocks and 989 TFLOP/s"),
        ("memory-bound kernels", "the H200's fractions of HBM bandwidth, of 3.35 TB/s (HBM3) instead of 4.8"),
        ("mfu_cap", "the H200's best measured step (an H100 has less bandwidth, the same compute)"),
        ("validation", "none on an H100 here"),
    ),
)  # fmt: skip

A100_MATMUL_EFFICIENCY = 0.70
"""Fraction of 312 TFLOP/s the GEMMs reach on A100: the least-squares fit over Megatron-LM 2021's table."""

A100_MFU_CAP = 0.559
"""Megatron-LM's 1T model at 56.3% MFU on A100 (Korthikanti et al. 2022), by ``StepEstimate.mfu``'s count."""

A100_MFU_BY_SIZE = ((22e9, 0.404), (175e9, 0.507), (530e9, 0.555), (1000e9, A100_MFU_CAP))
"""Megatron-LM's A100 MFU at 22B, 175B, 530B, 1T (41.5, 51.4, 56.0, 56.3%) by ``StepEstimate.mfu``'s count."""

A100_RATES = KernelRates(
    name="a100-80gb, calibrated on Megatron-LM 2021",
    matmul_efficiency=A100_MATMUL_EFFICIENCY,
    rms_norm=KernelRate(0.85),
    layer_norm=KernelRate(0.85),
    swiglu=KernelRate(0.85),
    gelu=KernelRate(0.85),
    rope=KernelRate(0.85),
    cross_entropy=KernelRate(0.85),
    elementwise=KernelRate(0.85),
    optimizer=KernelRate(0.85),
    attention=H200_RATES.attention,
    window_attention=H200_RATES.window_attention,
    mfu_cap=A100_MFU_CAP,
    mfu_cap_by_size=A100_MFU_BY_SIZE,
    sources=(
        ("matmul_efficiency", "least-squares fit over Megatron-LM 2021 Table 1 (arXiv 2104.04473), 10 rows"),
        ("memory-bound kernels", "0.85 of 2.04 TB/s, backward twice the forward: fitted with the GEMMs on that table"),
        ("attention", "the H200's measured fractions of peak (51% forward+backward; FlashAttention-2: 50-73%)"),
        ("mfu_cap", "Megatron-LM's A100 MFU by size, 22B 41.5% .. 1T 56.3% (Korthikanti et al. 2022, arXiv "
                    "2205.05198; Megatron-LM README), less 0.7-2.6% for this count's halved causal attention"),
    ),
)  # fmt: skip
