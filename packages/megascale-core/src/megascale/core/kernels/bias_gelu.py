"""GeLU (tanh approximation, as GPT-2 and Megatron) of x + bias, fused so the sum is never stored.

Backends, fastest first: ``triton`` (kernels/triton/bias_gelu.py), ``torch`` (the reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megascale.core.kernels import triton as _triton
from megascale.core.kernels.registry import Probe, ProbeInputs, get_kernel

__all__ = ["bias_gelu"]

bias_gelu = get_kernel("bias_gelu")


@bias_gelu.register("triton", _triton.unavailable, unavailable_if_forced=_triton.unavailable_if_forced)
def _triton_backend(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from megascale.core.kernels.triton.bias_gelu import bias_gelu as fused

    return fused(x, bias)


@bias_gelu.register("torch")
def _reference(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.gelu(x if bias is None else x + bias, approximate="tanh")


def _probe(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> ProbeInputs:
    x, bias = torch.randn(4, 64, generator=gen), 0.1 * torch.randn(64, generator=gen)
    return (x.to(device, dtype), bias.to(device, dtype)), {}, (0, 1)


bias_gelu.probe = Probe(_probe)
