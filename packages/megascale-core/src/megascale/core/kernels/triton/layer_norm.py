"""Triton LayerNorm over the last dimension: forward, and backward with the gradients of x, weight and bias.

Same layout as rms_norm: the forward keeps a row in registers and stores mean and 1/std in fp32 (8 bytes a
row); the backward walks contiguous runs of rows per program, writing dx and accumulating dweight and dbias
in fp32 registers, and torch sums the few partial rows. ``bias`` may be None (HAS_BIAS is a compile-time
switch, so no dummy tensor is read).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megascale.core.kernels.triton._launch import as_rows, num_warps, reduction_programs, row_block

__all__ = ["layer_norm"]


@triton.jit
def _forward(X, W, B, Y, MEAN, RSTD, stride_x, stride_y, N, eps, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / N
    xc = tl.where(mask, x - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=0) / N + eps)  # biased variance, as F.layer_norm
    y = xc * rstd * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _backward(
    DY,
    X,
    W,
    MEAN,
    RSTD,
    DX,
    DW_PARTIAL,
    DB_PARTIAL,
    stride_dy,
    stride_x,
    stride_dx,
    M,
    N,
    rows_per_program,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    db = tl.zeros((BLOCK,), dtype=tl.float32)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, M)
    first64 = first.to(tl.int64)  # row * stride may pass 2**31 elements
    for i in range(0, last - first):
        row = first64 + i
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + row)
        rstd = tl.load(RSTD + row)
        xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        wdy = w * dy
        # d/dx of (x - mean) * rstd: rstd * (wdy - mean(wdy) - xhat * mean(xhat * wdy)).
        c1 = tl.sum(xhat * wdy, axis=0) / N
        c2 = tl.sum(wdy, axis=0) / N
        dx = rstd * (wdy - c2 - xhat * c1)
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        db += dy
    tl.store(DW_PARTIAL + pid * N + cols, dw, mask=mask)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + pid * N + cols, db, mask=mask)


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
    ) -> torch.Tensor:
        x2 = as_rows(x)
        M, N = x2.shape
        weight = weight.contiguous()
        bias = None if bias is None else bias.contiguous()
        block = row_block(N, "layer_norm")
        y = torch.empty((M, N), dtype=x.dtype, device=x.device)
        mean = torch.empty(M, dtype=torch.float32, device=x.device)
        rstd = torch.empty(M, dtype=torch.float32, device=x.device)
        if M:
            _forward[(M,)](
                x2,
                weight,
                weight if bias is None else bias,
                y,
                mean,
                rstd,
                x2.stride(0),
                y.stride(0),
                N,
                eps,
                HAS_BIAS=bias is not None,
                BLOCK=block,
                num_warps=num_warps(block),
            )
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.x_shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, mean, rstd = ctx.saved_tensors
        M, N = x2.shape
        dy2 = as_rows(dy)
        dx = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
        programs, per_program = reduction_programs(M, x2.device)
        dw_partial = torch.zeros((max(programs, 1), N), dtype=torch.float32, device=x2.device)
        db_partial = torch.zeros_like(dw_partial) if ctx.has_bias else dw_partial
        if M:
            block = row_block(N, "layer_norm")
            _backward[(programs,)](
                dy2,
                x2,
                weight,
                mean,
                rstd,
                dx,
                dw_partial,
                db_partial,
                dy2.stride(0),
                x2.stride(0),
                dx.stride(0),
                M,
                N,
                per_program,
                HAS_BIAS=ctx.has_bias,
                BLOCK=block,
                num_warps=num_warps(block),
            )
        db = db_partial.sum(0).to(ctx.bias_dtype) if ctx.has_bias else None
        return dx.view(ctx.x_shape), dw_partial.sum(0).to(weight.dtype), db, None


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm of x over its last dimension, statistics in fp32, returned in x's dtype."""
    return _LayerNorm.apply(x, weight, bias, eps)
