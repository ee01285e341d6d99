"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight, statistics in fp32, output in x's dtype.

Backends, fastest first: ``apex`` (NVIDIA apex's fused CUDA kernel), ``triton`` (kernels/triton/rms_norm.py),
``torch`` (the reference).
"""

from __future__ import annotations

import torch

from megascale.core import _optional
from megascale.core.kernels import triton as _triton
from megascale.core.kernels.registry import Probe, ProbeInputs, get_kernel

__all__ = ["rms_norm"]

rms_norm = get_kernel("rms_norm")


@rms_norm.register("apex", _optional.apex_norms_unavailable)
def _apex(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    fused = _optional.apex_norms()
    assert fused is not None
    # apex's non-mixed kernel reads weight in x's dtype and returns x's dtype; the cast is a no-op when the
    # dtypes already agree and otherwise rounds the weight once (autograd casts its gradient back).
    return fused.fused_rms_norm_affine(x, weight.to(x.dtype), (x.shape[-1],), eps)


@rms_norm.register("triton", _triton.unavailable, unavailable_if_forced=_triton.unavailable_if_forced)
def _triton_backend(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from megascale.core.kernels.triton.rms_norm import rms_norm as fused

    return fused(x, weight, eps)


@rms_norm.register("torch")
def _reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def probe_sizes(device_type: str) -> tuple[int, int]:
    """(rows, width) of the norms' probes. On a GPU: more rows than the backward's programs (two per SM, up to
    500 SMs), so each sums several rows into its partial and the last one fewer; a width short of its power-of-
    two block (masked columns, 8 warps). The CPU (tests, Triton's interpreter) keeps a small one."""
    return (1001, 4000) if device_type == "cuda" else (4, 64)


def _probe(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> ProbeInputs:
    rows, width = probe_sizes(device.type)
    x = torch.randn(rows, width, generator=gen)
    weight = 1 + 0.1 * torch.randn(width, generator=gen)
    return (x.to(device, dtype), weight.to(device, dtype), 1e-6), {}, (0, 1)


rms_norm.probe = Probe(_probe)
