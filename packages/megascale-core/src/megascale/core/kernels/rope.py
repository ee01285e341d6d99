"""Rotary position embedding, half-split (GPT-NeoX) convention.

x: (B, T, H, hd); cos, sin: (T, hd/2) in fp32. Pairs are (x[..., i], x[..., i + hd/2]), each rotated by the
angle of position t and frequency i. Computed in fp32, returned in x's dtype.

Backends, fastest first: ``triton`` (kernels/triton/rope.py), ``torch`` (the reference).
"""

from __future__ import annotations

import torch

from megascale.core.kernels import triton as _triton
from megascale.core.kernels.registry import Probe, ProbeInputs, get_kernel

__all__ = ["apply_rope", "rope_tables"]

apply_rope = get_kernel("rope")


def rope_tables(
    seq_len: int, head_dim: int, theta: float, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (seq_len, head_dim // 2) fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


@apply_rope.register("triton", _triton.unavailable, unavailable_if_forced=_triton.unavailable_if_forced)
def _triton_backend(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    from megascale.core.kernels.triton.rope import apply_rope as fused

    return fused(x, cos, sin)


@apply_rope.register("torch")
def _reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c = cos[: x.shape[1]].unsqueeze(1)  # (T, 1, hd/2): broadcast over heads
    s = sin[: x.shape[1]].unsqueeze(1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def _probe(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> ProbeInputs:
    x = torch.randn(2, 8, 2, 16, generator=gen)  # (B, T, H, head_dim)
    cos, sin = rope_tables(8, 16, 10000.0, device)
    return (x.to(device, dtype), cos, sin), {}, (0,)


apply_rope.probe = Probe(_probe)
