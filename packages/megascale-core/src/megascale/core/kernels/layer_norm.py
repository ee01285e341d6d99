"""LayerNorm over the last dimension, statistics in fp32, output in x's dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megascale.core.kernels.registry import get_kernel

__all__ = ["layer_norm"]

layer_norm = get_kernel("layer_norm")


@layer_norm.register("torch")
def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    b = None if bias is None else bias.float()
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), b, eps).to(x.dtype)
