"""LayerNorm over the last dimension, statistics in fp32, output in x's dtype.

Backends, fastest first: ``apex`` (NVIDIA apex's fused CUDA kernel), ``triton``
(kernels/triton/layer_norm.py), ``torch`` (the reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megascale.core import _optional
from megascale.core.kernels import triton as _triton
from megascale.core.kernels.registry import Probe, ProbeInputs, get_kernel
from megascale.core.kernels.rms_norm import probe_sizes

__all__ = ["layer_norm"]

layer_norm = get_kernel("layer_norm")


@layer_norm.register("apex", _optional.apex_norms_unavailable)
def _apex(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    fused = _optional.apex_norms()
    assert fused is not None
    # apex's non-mixed kernel reads weight and bias in x's dtype and returns x's dtype (casts are no-ops when
    # the dtypes agree), and its affine entry point needs a bias tensor: a zero one stands in for None.
    w = weight.to(x.dtype)
    b = torch.zeros_like(w) if bias is None else bias.to(x.dtype)
    return fused.fused_layer_norm_affine(x, w, b, (x.shape[-1],), eps)


@layer_norm.register("triton", _triton.unavailable, unavailable_if_forced=_triton.unavailable_if_forced)
def _triton_backend(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    from megascale.core.kernels.triton.layer_norm import layer_norm as fused

    return fused(x, weight, bias, eps)


@layer_norm.register("torch")
def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    b = None if bias is None else bias.float()
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), b, eps).to(x.dtype)


def _probe(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> ProbeInputs:
    rows, width = probe_sizes(device.type)  # rms_norm's: the same two backward paths
    x = torch.randn(rows, width, generator=gen)
    weight, bias = 1 + 0.1 * torch.randn(width, generator=gen), 0.1 * torch.randn(width, generator=gen)
    return (x.to(device, dtype), weight.to(device, dtype), bias.to(device, dtype), 1e-5), {}, (0, 1, 2)


layer_norm.probe = Probe(_probe)
