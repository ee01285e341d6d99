"""Attention over keys held in position runs, block by block, never building a (queries × keys) mask.

A context-parallel rank's queries are two runs of consecutive positions (its chunks) and its keys a few runs
(chunks gathered from every rank, or the halo's tails and its own chunks). A (query run, key run) pair is
skipped when no query may see any key (keys after every query, or all before the window), computed without
a mask when every query sees every key, and masked only where the causal diagonal or the window's edge runs
through it (a mask of that block alone, made when needed). Blocks are merged with the online softmax of
flash attention (Dao et al. 2022): a running maximum and sum per query row, in fp32.

On a GPU the blocks are one FlexAttention call (``flex_blocks.py``: the same rule as its ``mask_mod``, its block
mask skipping the tiles no query sees). On the CPU each block runs through torch's fused flash-attention kernel (``_FlashCPUBlocks``: its forward
returns the block's log-sum-exp, merged as above; its backward, given the merged output and log-sum-exp,
returns exactly that block's gradients, as ring attention uses them); ``_BlockAttention`` is the reference,
in plain fp32 matmuls, and what devices without either run.

The backward recomputes each block's probabilities from the saved log-sum-exp, so what is saved for backward
is q, k, v, the output and one fp32 log-sum-exp per query and head — as flash attention saves, and nothing
quadratic. That is what makes a rank's activation memory fall as 1/cp: a dense boolean mask over the rank's
queries and the gathered keys would be s²/cp bytes per sequence, more than the activations themselves at
long sequences.

Packed documents (``documents``: the document id of every query and every key, (B, Tq) and (B, Tk)) add one
rule: a query sees only the keys of its own document. A block is then also skipped when no query of any row
shares a document with any of its keys, and masked where a boundary runs through it.

Grouped-query heads are handled by viewing the query heads as (kv heads × group): keys and values are never
repeated. The reference for the values: ``torch.nn.functional.scaled_dot_product_attention`` with the mask
built from the positions (``tests/core/test_context_parallel.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from megascale.core.kernels.attention import flex_runs_here
from megascale.core.parallel.cp.flex_blocks import flex_block_attention

__all__ = ["BlockPlan", "block_attention", "block_plan", "runs"]

FULL, MASKED = "full", "masked"
Run = tuple[int, int, int]  # (index of the first, its position, length)


def runs(pos: tuple[int, ...]) -> tuple[Run, ...]:
    """Maximal runs of consecutive positions in ``pos``: (index of the first, its position, length)."""
    out: list[Run] = []
    for i, p in enumerate(pos):
        if out and p == out[-1][1] + out[-1][2] and i == out[-1][0] + out[-1][2]:
            start, first, n = out[-1]
            out[-1] = (start, first, n + 1)
        else:
            out.append((i, p, 1))
    return tuple(out)


@dataclass(frozen=True)
class BlockPlan:
    """For each query run (index, position, length), the key runs it attends and whether they need a mask."""

    q_runs: tuple[Run, ...]
    pairs: tuple[tuple[tuple[Run, str], ...], ...]  # per query run: ((key run, FULL | MASKED), ...)
    window: int | None
    q_pos: tuple[int, ...] = ()  # the positions it was made for (FlexAttention's mask reads them)
    k_pos: tuple[int, ...] = ()


@lru_cache(maxsize=64)
def block_plan(q_pos: tuple[int, ...], k_pos: tuple[int, ...], window: int | None) -> BlockPlan:
    """Which (query run, key run) blocks to compute for causal attention with an optional sliding window
    (query t sees key s when t − window < s ≤ t)."""
    q_runs, k_runs = runs(q_pos), runs(k_pos)
    pairs = []
    for _, a, lq in q_runs:
        last_q = a + lq - 1
        mine: list[tuple[Run, str]] = []
        for k in k_runs:
            _, b, lk = k
            last_k = b + lk - 1
            if b > last_q or (window is not None and last_k <= a - window):
                continue  # every key after every query, or before every query's window
            inside = last_k <= a and (window is None or b > last_q - window)
            mine.append((k, FULL if inside else MASKED))
        pairs.append(tuple(mine))
    return BlockPlan(q_runs, tuple(pairs), window, q_pos, k_pos)


def _mask(a: int, lq: int, b: int, lk: int, window: int | None, device: torch.device) -> torch.Tensor:
    t = torch.arange(a, a + lq, device=device).unsqueeze(1)
    s = torch.arange(b, b + lk, device=device).unsqueeze(0)
    mask = s <= t
    if window is not None:
        mask &= s > t - window
    return mask


Documents = tuple[torch.Tensor, torch.Tensor]  # (B, Tq) and (B, Tk) document ids of the queries and keys


def _allowed(
    a: int, lq: int, b: int, lk: int, kind: str, window: int | None, qs: slice, ks: slice,
    documents: Documents | None, device: torch.device,
) -> tuple[torch.Tensor | None, bool]:  # fmt: skip
    """One block's boolean mask, (lq, lk) or with documents (B, lq, lk), None where every query sees every
    key; and whether the block may be skipped (documents: no query shares one with any key)."""
    mask = _mask(a, lq, b, lk, window, device) if kind == MASKED else None
    if documents is None:
        return mask, False
    same = documents[0][:, qs].unsqueeze(-1) == documents[1][:, ks].unsqueeze(-2)  # (B, lq, lk)
    if mask is not None:
        same &= mask
    if not bool(same.any()):
        return None, True
    return (None if bool(same.all()) else same), False


def _blocks(
    plan: BlockPlan, device: torch.device, documents: Documents | None = None
) -> Iterator[tuple[slice, slice, torch.Tensor | None]]:
    """Per computed block: query and key slices and its mask ((lq, lk), (B, 1, 1, lq, lk) with documents,
    to broadcast over grouped heads; or None)."""
    for (qi, a, lq), pairs in zip(plan.q_runs, plan.pairs):
        for (ki, b, lk), kind in pairs:
            qs, ks = slice(qi, qi + lq), slice(ki, ki + lk)
            mask, skip = _allowed(a, lq, b, lk, kind, plan.window, qs, ks, documents, device)
            if skip:
                continue
            yield qs, ks, (mask if mask is None or mask.dim() == 2 else mask[:, None, None])


def _grouped(t: torch.Tensor, kv: int) -> torch.Tensor:
    """(B, T, heads, hd) -> fp32 (B, KV, heads/KV, T, hd): query heads grouped by their key/value head."""
    B, T, H, hd = t.shape
    return t.float().view(B, T, kv, H // kv, hd).permute(0, 2, 3, 1, 4)


def _keys(t: torch.Tensor) -> torch.Tensor:
    """(B, T, KV, hd) -> fp32 (B, KV, 1, T, hd): broadcast over each group without copies."""
    return t.float().permute(0, 2, 1, 3).unsqueeze(2)


def _scores(qf: torch.Tensor, kf: torch.Tensor, qs: slice, ks: slice, mask: torch.Tensor | None,
            scale: float) -> torch.Tensor:  # fmt: skip
    """One block's scaled scores, -inf where ``mask`` forbids."""
    s = torch.matmul(qf[..., qs, :], kf[..., ks, :].transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, -math.inf)


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: BlockPlan, scale: float, documents: Documents | None):
        B, Tq, H, hd = q.shape
        qf, kf, vf = _grouped(q, k.shape[2]), _keys(k), _keys(v)
        out = qf.new_zeros(qf.shape)
        lse = qf.new_full(qf.shape[:-1], -math.inf)  # the running row maximum, until the end
        sums = qf.new_zeros(qf.shape[:-1])  # the running row sum of exp(score − maximum)
        for qs, ks, mask in _blocks(plan, q.device, documents):
            s = _scores(qf, kf, qs, ks, mask, scale)
            m_old = lse[..., qs]
            m_new = torch.maximum(m_old, s.amax(-1))
            safe = torch.where(torch.isinf(m_new), 0.0, m_new)  # rows that saw no key yet
            p = torch.exp(s - safe.unsqueeze(-1))
            alpha = torch.exp(m_old - safe)
            out[..., qs, :] = out[..., qs, :] * alpha.unsqueeze(-1) + torch.matmul(p, vf[..., ks, :])
            sums[..., qs] = sums[..., qs] * alpha + p.sum(-1)
            lse[..., qs] = m_new
        out = out / sums.unsqueeze(-1)
        lse = lse + sums.log()  # every query sees itself: no empty row
        # contiguous: (B, T, H·hd) views of it are what the output projection reads and saves, one storage
        result = out.permute(0, 3, 1, 2, 4).reshape(B, Tq, H, hd).to(q.dtype).contiguous()
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.plan, ctx.scale, ctx.documents = plan, scale, documents
        return result

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        kv = k.shape[2]
        qf, of, gf = _grouped(q, kv), _grouped(out, kv), _grouped(grad, kv)
        kf, vf = _keys(k), _keys(v)
        delta = (gf * of).sum(-1)  # rowsum(dO ∘ O)
        dq = torch.zeros_like(qf)
        dk = torch.zeros_like(kf)
        dv = torch.zeros_like(vf)
        for qs, ks, mask in _blocks(ctx.plan, q.device, ctx.documents):
            p = torch.exp(_scores(qf, kf, qs, ks, mask, ctx.scale) - lse[..., qs].unsqueeze(-1))
            g = gf[..., qs, :]
            dv[..., ks, :] += torch.matmul(p.transpose(-1, -2), g).sum(2, keepdim=True)
            ds = p * (torch.matmul(g, vf[..., ks, :].transpose(-1, -2)) - delta[..., qs].unsqueeze(-1))
            dq[..., qs, :] += torch.matmul(ds, kf[..., ks, :]) * ctx.scale
            dk[..., ks, :] += (
                torch.matmul(ds.transpose(-1, -2), qf[..., qs, :]).sum(2, keepdim=True) * ctx.scale
            )
        dq = dq.permute(0, 3, 1, 2, 4).reshape(q.shape).to(q.dtype)
        dk, dv = (t.squeeze(2).permute(0, 2, 1, 3).to(k.dtype) for t in (dk, dv))
        return dq, dk, dv, None, None, None


def _flash_cpu_blocks(
    plan: BlockPlan, device: torch.device, dtype: torch.dtype, documents: Documents | None = None
) -> Iterator[tuple[slice, slice, bool, torch.Tensor | None, torch.Tensor | None]]:
    """Per block: query and key slices, is_causal, an additive mask ((lq, lk) or (B, 1, lq, lk)), or None, and
    the rows that see no key."""
    for (qi, a, lq), pairs in zip(plan.q_runs, plan.pairs):
        for (ki, b, lk), kind in pairs:
            qs, ks = slice(qi, qi + lq), slice(ki, ki + lk)
            if documents is None and kind == MASKED and a == b and lq == lk and plan.window is None:
                yield qs, ks, True, None, None  # the diagonal: the op's own causal mask (top-left) is exact
                continue
            allowed, skip = _allowed(a, lq, b, lk, kind, plan.window, qs, ks, documents, device)
            if skip:
                continue
            if allowed is None:
                yield qs, ks, False, None, None
                continue
            if allowed.dim() == 3:  # (B, lq, lk): one mask for every head
                allowed = allowed.unsqueeze(1)
            mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, -math.inf)
            yield qs, ks, False, mask, ~allowed.any(-1)


class _FlashCPUBlocks(torch.autograd.Function):
    """The same blocks through torch's fused CPU flash-attention kernel (its forward gives each block's
    log-sum-exp to merge by; its backward, given the merged output and log-sum-exp, each block's gradients):
    what ``_BlockAttention`` computes, at the speed of SDPA."""

    @staticmethod
    def forward(ctx, q, k, v, plan: BlockPlan, scale: float, documents: Documents | None):
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, hd)
        out = torch.zeros(qh.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(qh.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
        for qs, ks, causal, mask, empty in _flash_cpu_blocks(plan, q.device, q.dtype, documents):
            o, m = _FLASH_CPU(
                qh[:, :, qs], kh[:, :, ks], vh[:, :, ks], 0.0, causal, attn_mask=mask, scale=scale
            )
            if empty is not None:  # the kernel gives rows that see no key a log-sum-exp of 0: none
                m = m.masked_fill(empty, -math.inf)
            merged = torch.logaddexp(lse[:, :, qs], m)
            keep = torch.where(torch.isinf(merged), 0.0, torch.exp(lse[:, :, qs] - merged))
            add = torch.where(torch.isinf(merged), 0.0, torch.exp(m - merged))
            out[:, :, qs] = out[:, :, qs] * keep.unsqueeze(-1) + o.float() * add.unsqueeze(-1)
            lse[:, :, qs] = merged
        result = out.transpose(1, 2).to(q.dtype).contiguous()  # (B, T, heads, hd), as _BlockAttention's
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.plan, ctx.scale, ctx.documents = plan, scale, documents
        return result

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        qh, kh, vh, oh, gh = (t.transpose(1, 2) for t in (q, k, v, out, grad.contiguous()))
        dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (qh, kh, vh))
        for qs, ks, causal, mask, _ in _flash_cpu_blocks(ctx.plan, q.device, q.dtype, ctx.documents):
            gq, gk, gv = _FLASH_CPU_BACKWARD(gh[:, :, qs], qh[:, :, qs], kh[:, :, ks], vh[:, :, ks], oh[:, :, qs],
                                             lse[:, :, qs], 0.0, causal, attn_mask=mask, scale=ctx.scale)  # fmt: skip
            dq[:, :, qs] += gq
            dk[:, :, ks] += gk
            dv[:, :, ks] += gv
        return (*(t.transpose(1, 2).to(q.dtype) for t in (dq, dk, dv)), None, None, None)


_FLASH_CPU: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD: Any = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None
)


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockPlan,
    scale: float | None = None,
    *,
    fused: bool = True,
    documents: Documents | None = None,
    flex: bool | None = None,
) -> torch.Tensor:
    """Softmax attention of q (B, Tq, H, hd) over k, v (B, Tk, KV, hd) at the positions ``plan`` was made for
    (``block_plan``): (B, Tq, H, hd), in q's dtype. ``documents``: the (B, Tq) and (B, Tk) document ids of the
    queries and keys of packed rows; a query then sees only its own document's keys (every query must see
    at least itself).

    On a GPU where FlexAttention is compiled and passed its check (``flex=None``; ``flex=True`` forces it, on
    the CPU too: its eager reference, for tests), one FlexAttention call over every block (``flex_blocks.py``).
    On the CPU, with ``fused`` (the default) and torch's fused CPU flash-attention kernel present, each block
    runs through it; otherwise (``fused=False``: the reference) through the fp32 matmuls and online softmax of
    ``_BlockAttention``. Both save the same tensors."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if fused and (flex if flex is not None else flex_runs_here(q.device)):
        return flex_block_attention(q, k, v, plan.q_pos, plan.k_pos, plan.window, scale, documents)
    if fused and q.device.type == "cpu" and _FLASH_CPU is not None and _FLASH_CPU_BACKWARD is not None:
        return _FlashCPUBlocks.apply(q, k, v, plan, scale, documents)
    return _BlockAttention.apply(q, k, v, plan, scale, documents)
