"""Triton SwiGLU gate, silu(gate) * up: forward, and backward with the gradients of gate and up.

Elementwise over the flattened tensors, in fp32 registers. The backward recomputes sigmoid(gate) from the
saved gate instead of storing silu(gate): one more exp per element against a whole tensor of memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["swiglu"]

_BLOCK = 1024


@triton.jit
def _forward(G, U, Y, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _backward(DY, G, U, DG, DU, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    silu = g * s
    # d silu(g) / dg = s + g s (1 - s) = s (1 + g (1 - s))
    tl.store(DG + offs, (dy * u * s * (1.0 + g * (1.0 - s))).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offs, (dy * silu).to(DU.dtype.element_ty), mask=mask)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if gate.shape != up.shape:
            raise ValueError(f"swiglu expects gate and up of one shape, got {gate.shape} and {up.shape}")
        g, u = gate.contiguous(), up.contiguous()
        y = torch.empty(g.shape, dtype=torch.promote_types(g.dtype, u.dtype), device=g.device)
        if g.numel():
            _forward[(triton.cdiv(g.numel(), _BLOCK),)](g, u, y, g.numel(), BLOCK=_BLOCK)
        ctx.save_for_backward(g, u)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        g, u = ctx.saved_tensors
        dy = dy.contiguous()
        dg, du = torch.empty_like(g), torch.empty_like(u)
        if g.numel():
            _backward[(triton.cdiv(g.numel(), _BLOCK),)](dy, g, u, dg, du, g.numel(), BLOCK=_BLOCK)
        return dg, du


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, computed in fp32 and returned in the inputs' (promoted) dtype."""
    return _SwiGLU.apply(gate, up)
