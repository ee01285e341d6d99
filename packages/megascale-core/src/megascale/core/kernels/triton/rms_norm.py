"""Triton RMSNorm over the last dimension: forward, and backward with the gradients of x and weight.

Forward: one program per row keeps the row in registers, computes 1/rms in fp32 and stores it (4 bytes a row)
for the backward, which then reads x once instead of recomputing the statistic from a second pass.
Backward: each program walks a contiguous run of rows, writes dx row by row and accumulates its share of
dweight in fp32 registers; the few partial rows are summed by torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megascale.core.kernels.triton._launch import as_rows, num_warps, reduction_programs, row_block

__all__ = ["rms_norm"]


@triton.jit
def _forward(X, W, Y, RSTD, stride_x, stride_y, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    tl.store(RSTD + row, rstd)
    tl.store(Y + row * stride_y + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _backward(
    DY,
    X,
    W,
    RSTD,
    DX,
    DW_PARTIAL,
    stride_dy,
    stride_x,
    stride_dx,
    M,
    N,
    rows_per_program,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, M)
    first64 = first.to(tl.int64)  # row * stride may pass 2**31 elements
    for i in range(0, last - first):
        row = first64 + i
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        xhat = x * rstd
        wdy = w * dy
        # d/dx of x * rstd(x): rstd * (wdy - xhat * mean(xhat * wdy)); padded lanes are 0 in both terms.
        dx = rstd * (wdy - xhat * (tl.sum(xhat * wdy, axis=0) / N))
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
    tl.store(DW_PARTIAL + pid * N + cols, dw, mask=mask)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x2 = as_rows(x)
        M, N = x2.shape
        weight = weight.contiguous()
        block = row_block(N, "rms_norm")
        y = torch.empty((M, N), dtype=x.dtype, device=x.device)
        rstd = torch.empty(M, dtype=torch.float32, device=x.device)
        if M:
            _forward[(M,)](
                x2,
                weight,
                y,
                rstd,
                x2.stride(0),
                y.stride(0),
                N,
                eps,
                BLOCK=block,
                num_warps=num_warps(block),
            )
        ctx.save_for_backward(x2, weight, rstd)
        ctx.x_shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        M, N = x2.shape
        dy2 = as_rows(dy)
        dx = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
        programs, per_program = reduction_programs(M, x2.device)
        dw_partial = torch.zeros((max(programs, 1), N), dtype=torch.float32, device=x2.device)
        if M:
            block = row_block(N, "rms_norm")
            _backward[(programs,)](
                dy2,
                x2,
                weight,
                rstd,
                dx,
                dw_partial,
                dy2.stride(0),
                x2.stride(0),
                dx.stride(0),
                M,
                N,
                per_program,
                BLOCK=block,
                num_warps=num_warps(block),
            )
        return dx.view(ctx.x_shape), dw_partial.sum(0).to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension, in fp32, returned in x's dtype."""
    return _RMSNorm.apply(x, weight, eps)
