"""Rotary position embedding, half-split (GPT-NeoX) convention.

x: (B, T, H, hd); cos, sin: (T, hd/2) in fp32, or (B, T, hd/2): each row's own positions (packed documents,
whose positions restart at each document; the torch reference serves those). Pairs are (x[..., i], x[..., i + hd/2]), each rotated by the
angle of position t and frequency i. Computed in fp32, returned in x's dtype.

The tables are computed in fp32 with the operations, in the order, of Meta's Llama reference and Hugging Face
transformers (frequencies ``1 / theta^(2i/hd)``, then angle = position × frequency, both rounded to fp32): the
angles then match theirs bit for bit, so a checkpoint trained there sees the same rotations here. (Exact
float64 angles differ from those by up to position × 6e-8 radians: 5e-4 at position 8192.)

Backends, fastest first: ``triton`` (kernels/triton/rope.py), ``torch`` (the reference).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from megascale.core.kernels import triton as _triton
from megascale.core.kernels.registry import Probe, ProbeInputs, get_kernel

if TYPE_CHECKING:
    from megascale.core.config import RopeScaling

__all__ = ["apply_rope", "rope_frequencies", "rope_tables"]

apply_rope = get_kernel("rope")


def rope_frequencies(
    head_dim: int,
    theta: float,
    scaling: RopeScaling | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The head_dim/2 rotary frequencies (radians per position), fp32, rescaled by ``scaling`` if given."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    # Llama 3.1's rule, term by term as in Meta's reference (and transformers' _compute_llama3_parameters),
    # so the fp32 roundings agree
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old_len = scaling.original_max_seq_len
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_tables(
    seq_len: int,
    head_dim: int,
    theta: float,
    device: torch.device | str | None = None,
    scaling: RopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (seq_len, head_dim // 2) fp32 (see the module docstring for the rounding)."""
    inv_freq = rope_frequencies(head_dim, theta, scaling, device)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.int64).float(), inv_freq)
    return angles.cos(), angles.sin()


@apply_rope.register("triton", _triton.unavailable, unavailable_if_forced=_triton.unavailable_if_forced)
def _triton_backend(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if cos.dim() == 3:  # per-row tables (packed documents): the fused kernel reads one table for every row
        return _reference(x, cos, sin)
    from megascale.core.kernels.triton.rope import apply_rope as fused

    return fused(x, cos, sin)


@apply_rope.register("torch")
def _reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    if cos.dim() == 3:  # (B, T, hd/2): each row's positions
        c, s = cos.unsqueeze(2), sin.unsqueeze(2)  # (B, T, 1, hd/2)
    else:
        c = cos[: x.shape[1]].unsqueeze(1)  # (T, 1, hd/2): broadcast over heads
        s = sin[: x.shape[1]].unsqueeze(1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def _probe(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> ProbeInputs:
    x = torch.randn(2, 8, 2, 16, generator=gen)  # (B, T, H, head_dim)
    cos, sin = rope_tables(8, 16, 10000.0, device)
    return (x.to(device, dtype), cos, sin), {}, (0,)


apply_rope.probe = Probe(_probe)
