"""Packed documents for the attention kernels: document ids, and what each backend needs of them.

A packed row holds several documents; ``position_ids`` (B, T) restart at 0 at each document's first token
(transformers' and torchtitan's convention), and ``document_ids`` numbers the documents of each row. What a
backend builds from them — SDPA's dense (B, 1, T, T) mask, FlexAttention's block mask, flash-attn's
``cu_seqlens`` — is built once per microbatch and reused by every layer: the values are cached by the identity
(and version) of the tensor they come from, which every layer of one forward is handed, never for another.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, TypeVar

import torch

__all__ = ["VarlenSegments", "attention_mask", "document_ids", "document_mask", "varlen_segments"]

T = TypeVar("T")


class _ByIdentity:
    """A few values, each keyed by one tensor's identity and version and a small key."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._entries: list[tuple[weakref.ref[torch.Tensor], int, Hashable, Any]] = []

    def get(self, tensor: torch.Tensor, key: Hashable, build: Callable[[], T]) -> T:
        if torch.compiler.is_compiling() or type(tensor) is not torch.Tensor:
            return build()  # traced values are not kept across calls
        for ref, version, k, value in self._entries:
            if ref() is tensor and version == tensor._version and k == key:
                return value
        value = build()
        alive = [e for e in self._entries if e[0]() is not None][-(self.size - 1) :]
        self._entries = [*alive, (weakref.ref(tensor), tensor._version, key, value)]
        return value


_CACHE = _ByIdentity()


def cached(tensor: torch.Tensor, key: Hashable, build: Callable[[], T]) -> T:
    """``build()``, computed once per (``tensor`` object and version, ``key``) while ``tensor`` lives."""
    return _CACHE.get(tensor, key, build)


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids of packed rows whose positions restart at 0 at each document's first token (the
    same tensor for every layer given the same ``position_ids``)."""
    return cached(position_ids, "document ids", lambda: (position_ids == 0).cumsum(dim=-1))


@lru_cache(maxsize=32)
def attention_mask(t: int, window: int | None, device: torch.device) -> torch.Tensor:
    """(t, t) boolean mask, True where a query (row) may attend a key (column)."""
    i = torch.arange(t, device=device).unsqueeze(1)
    j = torch.arange(t, device=device).unsqueeze(0)
    mask = j <= i
    if window is not None:
        mask &= j > i - window
    return mask


def document_mask(documents: torch.Tensor, window: int | None) -> torch.Tensor:
    """(B, 1, T, T) boolean mask, True where a query (row) may attend a key (column): same document, causal and
    within the window (the reference's, and SDPA's off the GPU path)."""

    def build() -> torch.Tensor:
        same = documents.unsqueeze(-1) == documents.unsqueeze(-2)  # (B, T, T)
        return (same & attention_mask(documents.shape[-1], window, documents.device)).unsqueeze(1)

    return cached(documents, ("dense mask", window), build)


@dataclass(frozen=True)
class VarlenSegments:
    """flash-attn's varlen form of packed rows: the rows flattened to (B·T) tokens, cut at every document's
    start and every row's; ``cu_seqlens`` (segments + 1,) int32 offsets, ``max_seqlen`` the longest."""

    cu_seqlens: torch.Tensor
    max_seqlen: int


def varlen_segments(documents: torch.Tensor) -> VarlenSegments:
    """The segments of ``documents`` (B, T), once per microbatch (``max_seqlen`` costs one device sync)."""

    def build() -> VarlenSegments:
        B, T = documents.shape
        starts = torch.ones_like(documents, dtype=torch.bool)
        starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
        offsets = starts.flatten().nonzero().squeeze(1)
        cu = torch.cat((offsets, offsets.new_tensor([B * T]))).to(torch.int32)
        return VarlenSegments(cu, int((cu[1:] - cu[:-1]).max()))

    return cached(documents, "varlen", build)
