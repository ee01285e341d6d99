"""Triton cross-entropy over a (possibly padded) vocabulary, fused and chunked: no fp32 logits in memory.

Forward: one program per row walks the vocabulary in blocks of BLOCK_V columns with an online log-sum-exp
(running max and rescaled sum in fp32 registers), picking the target's logit on the way. It stores the row's
loss and log-sum-exp (4 bytes each); columns >= ``vocab_size`` are padding and never enter the softmax.
Backward: one program per row walks the vocabulary again and writes
``(softmax - onehot(target)) * scale`` straight in the logits' dtype, where ``scale`` is the incoming gradient
(divided by the number of counted targets for "mean"); padding columns and ignored rows get exactly 0.

Why the gradient is computed in the backward (not in the forward and scaled later, as Liger does): peak memory
is the same (logits + one gradient-sized tensor either way, since here the logits are saved instead of the
gradient), the logits are read twice instead of three times and the gradient written once instead of twice,
the grad_output scale is applied in fp32 before the single rounding to bf16, and a forward without backward
(evaluation) pays for no gradient at all. The input logits are never overwritten.

Targets outside [0, vocab_size) other than ``ignore_index`` are not checked (that would cost a device sync):
they can't read out of bounds, but their loss is meaningless.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megascale.core.kernels.triton._launch import num_warps

__all__ = ["cross_entropy"]

_MAX_BLOCK_V = 8192  # vocabulary columns per step: 128256 columns take 16 steps per row


@triton.jit
def _forward(
    LOGITS,
    TARGETS,
    LOSS,
    LSE,
    stride_row,
    V_VALID,
    ignore_index,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_row
    target = tl.load(TARGETS + row)
    m = float("-inf")  # running max
    s = 0.0  # running sum of exp(x - m)
    target_logit = 0.0
    # Only columns < V_VALID are visited, so every block holds at least one real logit and m is finite
    # after the first step (no -inf - -inf).
    for start in range(0, V_VALID, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, mask=cols < V_VALID, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
        target_logit += tl.sum(tl.where(cols == target, x, 0.0), axis=0)
    lse = m + tl.log(s)
    tl.store(LSE + row, lse)
    tl.store(LOSS + row, tl.where(target != ignore_index, lse - target_logit, 0.0))


@triton.jit
def _backward(
    LOGITS,
    TARGETS,
    LSE,
    SCALE,
    DLOGITS,
    stride_row,
    stride_drow,
    stride_scale,
    V,
    V_VALID,
    ignore_index,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_row
    dbase = DLOGITS + row * stride_drow
    target = tl.load(TARGETS + row)
    lse = tl.load(LSE + row)
    # tl.where, not a multiply: an ignored row gets 0 even when the scale is inf or nan (mean over 0 targets).
    scale = tl.where(target != ignore_index, tl.load(SCALE + row * stride_scale).to(tl.float32), 0.0)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, mask=cols < V_VALID, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - lse)  # softmax; 0 on padding columns
        grad = (p - tl.where(cols == target, 1.0, 0.0)) * scale
        tl.store(dbase + cols, grad.to(DLOGITS.dtype.element_ty), mask=cols < V)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        targets: torch.Tensor,
        vocab_size: int | None,
        ignore_index: int,
        reduction: str,
        block_v: int | None,
    ) -> torch.Tensor:
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        V = logits.shape[-1]
        rows = logits.reshape(-1, V)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        targets = targets.reshape(-1).contiguous()
        if targets.numel() != rows.shape[0]:
            raise ValueError(f"cross_entropy: {rows.shape[0]} rows of logits but {targets.numel()} targets")
        v_valid = V if vocab_size is None else min(vocab_size, V)
        if v_valid < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        block = block_v or min(triton.next_power_of_2(v_valid), _MAX_BLOCK_V)
        M = rows.shape[0]
        loss = torch.empty(M, dtype=torch.float32, device=logits.device)
        lse = torch.empty(M, dtype=torch.float32, device=logits.device)
        if M:
            _forward[(M,)](
                rows,
                targets,
                loss,
                lse,
                rows.stride(0),
                v_valid,
                ignore_index,
                BLOCK_V=block,
                num_warps=num_warps(block),
            )
        counted = (targets != ignore_index).sum()
        ctx.save_for_backward(rows, targets, lse, counted)
        ctx.meta = (logits.shape, v_valid, ignore_index, reduction, block)
        if reduction == "none":
            return loss
        total = loss.sum()
        return total / counted if reduction == "mean" else total  # mean over 0 targets is nan, as in torch

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        rows, targets, lse, counted = ctx.saved_tensors
        shape, v_valid, ignore_index, reduction, block = ctx.meta
        M, V = rows.shape
        # One scale per row: the incoming gradient, a 0-d tensor read with stride 0 unless reduction="none".
        scale = grad_out.float() / counted if reduction == "mean" else grad_out
        stride_scale = scale.stride(0) if scale.dim() else 0
        dlogits = torch.empty((M, V), dtype=rows.dtype, device=rows.device)
        if M:
            _backward[(M,)](
                rows,
                targets,
                lse,
                scale,
                dlogits,
                rows.stride(0),
                dlogits.stride(0),
                stride_scale,
                V,
                v_valid,
                ignore_index,
                BLOCK_V=block,
                num_warps=num_warps(block),
            )
        return dlogits.view(shape), None, None, None, None, None


def cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    block_v: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of logits (..., V) against targets (...); fp32 loss, gradient in the logits' dtype.

    ``block_v`` overrides the vocabulary block (a power of two), for tests of the multi-block path."""
    return _CrossEntropy.apply(logits, targets, vocab_size, ignore_index, reduction, block_v)
