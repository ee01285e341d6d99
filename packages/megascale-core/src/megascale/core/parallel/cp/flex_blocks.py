"""A context-parallel rank's attention as one FlexAttention call: the GPU's fused path for ``block_attention``.

The rank's queries and the keys it holds or brought in sit at known positions of the whole sequence
(``BlockPlan.q_pos``, ``k_pos``); the mask rule is the one ``block_attention`` applies block by block — causal
by position, the window, the same document — written as FlexAttention's ``mask_mod`` over those positions. Its
block mask skips the (128 × 128) tiles no query sees, and its kernel keeps each row's log-sum-exp itself, so
no merging is left to do: every key a query sees is on the rank. The block mask depends only on the layout
(cached per plan) or, with packed documents, on the microbatch (cached per its document ids, for every layer).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

from megascale.core.kernels.attention import flex_attention_call
from megascale.core.kernels.documents import cached

__all__ = ["flex_block_attention"]


def _mask_mod(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, documents: Any) -> Any:
    def allowed(b, h, q_idx, kv_idx):
        t, s = q_pos[q_idx], k_pos[kv_idx]
        keep = s <= t
        if window is not None:
            keep = keep & (t - s < window)
        if documents is not None:
            keep = keep & (documents[0][b, q_idx] == documents[1][b, kv_idx])
        return keep

    return allowed


def _build(q_pos: tuple[int, ...], k_pos: tuple[int, ...], window: int | None, documents: Any,
           device: torch.device) -> Any:  # fmt: skip
    from torch.nn.attention.flex_attention import create_block_mask

    qp = torch.tensor(q_pos, device=device)
    kp = torch.tensor(k_pos, device=device)
    batch = None if documents is None else documents[0].shape[0]
    return create_block_mask(_mask_mod(qp, kp, window, documents), B=batch, H=None, Q_LEN=len(q_pos),
                             KV_LEN=len(k_pos), device=device)  # fmt: skip


@lru_cache(maxsize=64)
def _layout_mask(
    q_pos: tuple[int, ...], k_pos: tuple[int, ...], window: int | None, device: torch.device
) -> Any:
    return _build(q_pos, k_pos, window, None, device)


def flex_block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: tuple[int, ...],
    k_pos: tuple[int, ...],
    window: int | None,
    scale: float,
    documents: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """q (B, Tq, H, hd) at positions ``q_pos``, k and v (B, Tk, KV, hd) at ``k_pos`` → (B, Tq, H, hd)."""
    if documents is None:
        block_mask = _layout_mask(q_pos, k_pos, window, q.device)
    else:
        block_mask = cached(
            documents[0], ("cp flex block mask", q_pos, k_pos, window),
            lambda: _build(q_pos, k_pos, window, documents, q.device),
        )  # fmt: skip
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    return flex_attention_call(qh, kh, vh, block_mask, scale).transpose(1, 2)
