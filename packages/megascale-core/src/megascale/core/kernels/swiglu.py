"""SwiGLU gate: silu(gate) * up (Shazeer 2020), fused so silu(gate) is never stored.

Backends, fastest first: ``triton`` (kernels/triton/swiglu.py), ``torch`` (the reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megascale.core.kernels import triton as _triton
from megascale.core.kernels.registry import Probe, ProbeInputs, get_kernel

__all__ = ["swiglu"]

swiglu = get_kernel("swiglu")


@swiglu.register("triton", _triton.unavailable, unavailable_if_forced=_triton.unavailable_if_forced)
def _triton_backend(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    from megascale.core.kernels.triton.swiglu import swiglu as fused

    return fused(gate, up)


@swiglu.register("torch")
def _reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _probe(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> ProbeInputs:
    gate, up = torch.randn(4, 64, generator=gen), torch.randn(4, 64, generator=gen)
    return (gate.to(device, dtype), up.to(device, dtype)), {}, (0, 1)


swiglu.probe = Probe(_probe)
