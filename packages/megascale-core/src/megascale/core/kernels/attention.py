"""Causal self-attention with optional sliding window and grouped-query heads.

Backends, fastest first: ``flash`` (flash-attn 2 on CUDA, fp16/bf16, native sliding window and GQA), ``sdpa``
(torch's scaled_dot_product_attention; a cached boolean mask carries the window), ``torch`` (explicit fp32
softmax: the reference). Window semantics, the same in every backend: query i sees keys j with
i - window < j <= i, i.e. ``window`` keys including itself.
"""

from __future__ import annotations

import logging
import math
from functools import lru_cache

import torch
import torch.nn.functional as F

from megascale.core import _optional
from megascale.core.kernels.registry import Probe, ProbeInputs, get_kernel

__all__ = ["attention", "attention_mask"]

log = logging.getLogger("megascale.core.kernels")
attention = get_kernel("attention")


@lru_cache(maxsize=32)
def attention_mask(t: int, window: int | None, device: torch.device) -> torch.Tensor:
    """(t, t) boolean mask, True where a query (row) may attend a key (column)."""
    i = torch.arange(t, device=device).unsqueeze(1)
    j = torch.arange(t, device=device).unsqueeze(0)
    mask = j <= i
    if window is not None:
        mask &= j > i - window
    return mask


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> None:
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"attention expects q (B, T, H, hd) and k, v (B, T, KV, hd); got {q.shape}, {k.shape}"
        )
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"causal attention needs as many queries as keys; got {q.shape[1]} and {k.shape[1]}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]})")
    if window is not None and window < 1:
        raise ValueError(f"sliding window must be >= 1 token, got {window}")


def _flash_unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "flash-attn runs on CUDA only"
    if _optional.flash_attn() is None:
        return _optional.missing_reason("flash_attn")
    return None


@attention.register("flash", _flash_unavailable)
def _flash(q, k, v, *, window: int | None = None, scale: float | None = None, dropout_p: float = 0.0):
    _check(q, k, v, window)
    if q.dtype not in (torch.float16, torch.bfloat16):
        # flash-attn has no fp32 kernel; fp32 runs are for debugging, so take the next-best path.
        return _sdpa(q, k, v, window=window, scale=scale, dropout_p=dropout_p)
    fa = _optional.flash_attn()
    assert fa is not None
    return fa.flash_attn_func(
        q,
        k,
        v,
        dropout_p=dropout_p,
        softmax_scale=scale,
        causal=True,
        window_size=(-1, -1) if window is None else (window - 1, 0),
    )


@attention.register("sdpa")
def _sdpa(q, k, v, *, window: int | None = None, scale: float | None = None, dropout_p: float = 0.0):
    _check(q, k, v, window)
    T = q.shape[1]
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, hd)
    gqa = q.shape[2] != k.shape[2]
    if window is None or window >= T:
        out = F.scaled_dot_product_attention(
            qh, kh, vh, dropout_p=dropout_p, is_causal=True, scale=scale, enable_gqa=gqa
        )
    else:
        mask = attention_mask(T, window, q.device)
        out = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
        )
    return out.transpose(1, 2)  # (B, T, H, hd)


@attention.register("torch")
def _reference(q, k, v, *, window: int | None = None, scale: float | None = None, dropout_p: float = 0.0):
    _check(q, k, v, window)
    _, T, H, hd = q.shape
    rep = H // k.shape[2]
    k = k.repeat_interleave(rep, dim=2)
    v = v.repeat_interleave(rep, dim=2)
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    scores = torch.einsum("bthd,bshd->bhts", q.float(), k.float()) * scale
    scores = scores.masked_fill(~attention_mask(T, window, q.device), float("-inf"))
    probs = F.dropout(scores.softmax(dim=-1), p=dropout_p, training=dropout_p > 0)
    return torch.einsum("bhts,bshd->bthd", probs, v.float()).to(q.dtype)


def _probe(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> ProbeInputs:
    q = torch.randn(2, 16, 4, 16, generator=gen)  # (B, T, H, head_dim), grouped-query: 2 kv heads
    k, v = torch.randn(2, 16, 2, 16, generator=gen), torch.randn(2, 16, 2, 16, generator=gen)
    return (q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)), {"window": 6}, (0, 1, 2)


attention.probe = Probe(_probe, {torch.float32: (1e-4, 1e-5), torch.bfloat16: (3e-2, 3e-2)})
