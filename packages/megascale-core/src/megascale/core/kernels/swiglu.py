"""SwiGLU gate: silu(gate) * up (Shazeer 2020), fused so silu(gate) is never stored."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megascale.core.kernels.registry import get_kernel

__all__ = ["swiglu"]

swiglu = get_kernel("swiglu")


@swiglu.register("torch")
def _reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up
