"""Triton GeLU (tanh approximation) of x + bias: forward, and backward with the gradients of x and bias.

The forward is elementwise over the flattened tensor and never stores x + bias; the backward recomputes it
from the saved x and bias (one extra read of bias, which is tiny). The backward tiles (rows x columns): each
program owns a column block and a contiguous run of rows, writes dx and sums its rows of dx into an fp32
partial dbias row; torch sums the few partial rows. tanh is written with exp (tanh(u) = 1 - 2/(1 + e^2u)),
which saturates correctly at both ends and needs no libdevice, so the interpreter runs it too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megascale.core.kernels.triton._launch import reduction_programs

__all__ = ["bias_gelu"]

_BLOCK = 1024  # elements per program in the forward
_BLOCK_M = 16  # backward tile: rows
_BLOCK_N = 128  # backward tile: columns


@triton.jit
def _tanh(u):
    # tanh(20) is 1 in fp32; the clamp keeps exp finite (the interpreter warns on overflow, GPUs don't care).
    return 1.0 - 2.0 / (1.0 + tl.exp(2.0 * tl.minimum(u, 20.0)))


@triton.jit
def _forward(X, B, Y, numel, N, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(B + offs % N, mask=mask, other=0.0).to(tl.float32)
    k = 0.7978845608028654  # sqrt(2 / pi)
    y = 0.5 * z * (1.0 + _tanh(k * (z + 0.044715 * z * z * z)))
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _backward(
    DY,
    X,
    B,
    DX,
    DB_PARTIAL,
    M,
    N,
    rows_per_program,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    pid_rows = tl.program_id(1)
    b = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_BIAS:
        b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    first = pid_rows * rows_per_program
    last = tl.minimum(first + rows_per_program, M)
    k = 0.7978845608028654  # sqrt(2 / pi)
    for r in range(first, last, BLOCK_M):
        rows = r + tl.arange(0, BLOCK_M)
        mask = (rows < last)[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32) + b[None, :]
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        t = _tanh(k * (z + 0.044715 * z * z * z))
        # d/dz of 0.5 z (1 + tanh(u(z))), u = k (z + 0.044715 z^3)
        dgelu = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * z * z)
        dz = dy * dgelu  # 0 on masked lanes, since dy is
        tl.store(DX + offs, dz.to(DX.dtype.element_ty), mask=mask)
        db += tl.sum(dz, axis=0)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + pid_rows * N + cols, db, mask=cmask)


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        N = x.shape[-1]
        if bias is not None and bias.shape != (N,):
            raise ValueError(f"bias_gelu expects a bias of shape ({N},), got {tuple(bias.shape)}")
        xc = x.contiguous()
        bc = None if bias is None else bias.contiguous()
        out_dtype = x.dtype if bias is None else torch.promote_types(x.dtype, bias.dtype)
        y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        if x.numel():
            _forward[(triton.cdiv(x.numel(), _BLOCK),)](
                xc, xc if bc is None else bc, y, x.numel(), N, HAS_BIAS=bc is not None, BLOCK=_BLOCK
            )
        ctx.save_for_backward(xc, bc)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, bias = ctx.saved_tensors
        N = x.shape[-1]
        M = x.numel() // N if N else 0
        dy = dy.contiguous()
        dx = torch.empty_like(x)
        programs, per_program = reduction_programs(M, x.device)
        db_partial = torch.zeros((max(programs, 1), N), dtype=torch.float32, device=x.device)
        if M:
            grid = (triton.cdiv(N, _BLOCK_N), programs)
            _backward[grid](
                dy,
                x,
                x if bias is None else bias,
                dx,
                db_partial,
                M,
                N,
                per_program,
                HAS_BIAS=bias is not None,
                BLOCK_M=_BLOCK_M,
                BLOCK_N=_BLOCK_N,
            )
        db = None if bias is None else db_partial.sum(0).to(bias.dtype)
        return dx, db


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """GeLU (tanh approximation) of x + bias, bias broadcast over the last dimension (or None)."""
    return _BiasGelu.apply(x, bias)
