"""Triton rotary position embedding, half-split (GPT-NeoX) convention: forward and backward.

x (B, T, H, hd) with any strides (q and k usually arrive as views of a fused qkv projection, so no copy is
made); cos, sin (>= T, hd/2) fp32. One program per (batch, position) loads that position's cos/sin row once
and rotates all heads: pairs (x[i], x[i + hd/2]) turn by the angle of position t and frequency i. The backward
is the same kernel turning by the opposite angle (sin negated), since a rotation's transpose is its inverse.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megascale.core.kernels.triton._launch import num_warps

__all__ = ["apply_rope"]


@triton.jit
def _rotate(
    X,
    COS,
    SIN,
    Y,
    T,
    H,
    HALF,
    sxb,
    sxt,
    sxh,
    sxd,
    syb,
    syt,
    syh,
    syd,
    stride_cs,
    SIGN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // T).to(tl.int64)
    t = (pid % T).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    dmask = d < HALF
    mask = (h < H) & dmask
    c = tl.load(COS + t * stride_cs + d, mask=dmask, other=0.0).to(tl.float32)
    s = SIGN * tl.load(SIN + t * stride_cs + d, mask=dmask, other=0.0).to(tl.float32)
    x_row = X + b * sxb + t * sxt + h * sxh
    x1 = tl.load(x_row + d * sxd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + (d + HALF) * sxd, mask=mask, other=0.0).to(tl.float32)
    y_row = Y + b * syb + t * syt + h * syh
    tl.store(y_row + d * syd, (x1 * c - x2 * s).to(Y.dtype.element_ty), mask=mask)
    tl.store(y_row + (d + HALF) * syd, (x2 * c + x1 * s).to(Y.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    B, T, H, hd = x.shape
    half = hd // 2
    y = torch.empty((B, T, H, hd), dtype=x.dtype, device=x.device)
    if x.numel():
        block_h, block_d = triton.next_power_of_2(H), triton.next_power_of_2(half)
        _rotate[(B * T,)](
            x,
            cos,
            sin,
            y,
            T,
            H,
            half,
            *x.stride(),
            *y.stride(),
            cos.stride(0),
            SIGN=sign,
            BLOCK_H=block_h,
            BLOCK_D=block_d,
            num_warps=num_warps(block_h * block_d),
        )
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[-1] % 2:
            raise ValueError(f"rope expects x (B, T, H, hd) with an even hd, got {tuple(x.shape)}")
        T, half = x.shape[1], x.shape[-1] // 2
        if cos.shape[0] < T or cos.shape[-1] != half or sin.shape != cos.shape:
            raise ValueError(
                f"rope expects cos and sin of shape (>= {T}, {half}), "
                f"got {tuple(cos.shape)} and {tuple(sin.shape)}"
            )
        # The tables are small; unit column stride lets the kernel index them with one row stride.
        cos = cos.float().contiguous()
        sin = sin.float().contiguous()
        ctx.save_for_backward(cos, sin)
        return _launch(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        cos, sin = ctx.saved_tensors
        # cos and sin are fixed tables (buffers), never trained: no gradient for them.
        return _launch(dy, cos, sin, -1.0), None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, H, hd) by the angles whose cos/sin tables are given, in fp32; returns x's dtype."""
    return _Rope.apply(x, cos, sin)
