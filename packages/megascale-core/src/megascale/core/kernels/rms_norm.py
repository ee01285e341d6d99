"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight, statistics in fp32, output in x's dtype."""

from __future__ import annotations

import torch

from megascale.core.kernels.registry import get_kernel

__all__ = ["rms_norm"]

rms_norm = get_kernel("rms_norm")


@rms_norm.register("torch")
def _reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)
