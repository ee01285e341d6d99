"""Self-attention: the projection-free core (rotary + softmax attention) and the sequential-block layer.

The core reads its head counts from the shapes it is given, so after tensor parallelism splits the heads it
simply sees fewer of them. Selective activation checkpointing recomputes this core alone. Its only
parameters are the optional per-head query/key norms (``qk_norm``), one ``head_dim`` weight each, shared by
all heads: tensor parallelism replicates them and sums their gradients over the ranks' heads.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from megascale.core import kernels
from megascale.core.config import GPTConfig
from megascale.core.model.linear import FanInLinear, FanOutLinear
from megascale.core.model.norm import make_norm
from megascale.core.model.rope import RotaryEmbedding

__all__ = ["Attention", "ChunkedSequenceAttention", "SelfAttention", "qkv_bias_names", "qkv_features"]


def qkv_features(config: GPTConfig) -> dict[str, int]:
    return {
        "q": config.n_heads * config.head_dim,
        "k": config.kv_heads * config.head_dim,
        "v": config.kv_heads * config.head_dim,
    }


def qkv_bias_names(config: GPTConfig) -> tuple[str, ...]:
    """The projections among q, k, v that carry a bias (all three with ``bias`` or ``qkv_bias``, else none)."""
    return ("q", "k", "v") if config.bias or config.qkv_bias else ()


class ChunkedSequenceAttention(Protocol):
    """Attention for a layout whose ranks each hold chunks of a longer sequence: the rotary tables at this
    rank's positions, and attention over the keys/values of every rank (context parallelism's
    ``megascale.core.parallel.cp.ContextParallel``)."""

    def rope_tables(
        self, cos: torch.Tensor, sin: torch.Tensor, local_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rope_tables_at(
        self, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        window: int | None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class SelfAttention(nn.Module):
    """softmax(rope(q) rope(k)^T / sqrt(hd) + causal/window mask) v, on (B, T, heads·hd) projections.

    With ``qk_norm``, q and k are normalised per head (``q_norm``, ``k_norm``) before the rotary embedding.
    Under context parallelism (``context_parallel``, set by ``apply_context_parallel``) the tokens are two
    chunks of a longer sequence: rotary angles at their positions, keys/values of the others brought in.
    """

    context_parallel: ChunkedSequenceAttention | None = None

    def __init__(self, config: GPTConfig, rope: RotaryEmbedding, window: int | None) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.window = window
        self.dropout = config.dropout
        self.rope = rope
        self.rope_backend = config.kernels.get("rope")
        self.attention_backend = config.kernels.get("attention")
        self.q_norm = make_norm(config, config.head_dim) if config.qk_norm else None
        self.k_norm = make_norm(config, config.head_dim) if config.qk_norm else None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``position_ids`` (B, T): packed documents, positions restarting at 0 at each document's first token;
        rotary angles at those positions, and each token attends only to its own document. Under context
        parallelism they are the whole sequences' (the tokens here, the rank's chunks)."""
        B, T, _ = q.shape
        q = q.view(B, T, -1, self.head_dim)  # (B, T, H, hd)
        k = k.view(B, T, -1, self.head_dim)  # (B, T, KV, hd)
        v = v.view(B, T, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = self.rope.cos, self.rope.sin
        cp = self.context_parallel
        documents = None
        if cp is not None:
            if position_ids is None:
                cos, sin = cp.rope_tables(cos, sin, T)
            else:
                cos, sin = cp.rope_tables_at(cos, sin, position_ids)
        elif position_ids is not None:
            cos, sin = cos[position_ids], sin[position_ids]  # (B, T, hd/2)
            documents = kernels.document_ids(position_ids)
        q = kernels.apply_rope(q, cos, sin, backend=self.rope_backend)
        k = kernels.apply_rope(k, cos, sin, backend=self.rope_backend)
        if cp is not None:
            return cp.attention(q, k, v, window=self.window, position_ids=position_ids).reshape(B, T, -1)
        y = kernels.attention(
            q,
            k,
            v,
            window=self.window,
            dropout_p=self.dropout if self.training else 0.0,
            documents=documents,
            backend=self.attention_backend,
        )
        return y.reshape(B, T, -1)  # (B, T, H·hd)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, window={self.window}"


class Attention(nn.Module):
    """Multi-head (or grouped-query) attention with its own projections, for the sequential block."""

    def __init__(self, config: GPTConfig, rope: RotaryEmbedding, window: int | None) -> None:
        super().__init__()
        qkv = qkv_features(config)
        self.in_proj = FanOutLinear(config.d_model, qkv, bias=qkv_bias_names(config))
        self.core = SelfAttention(config, rope, window)
        self.out_proj = FanInLinear({"o": qkv["q"]}, config.d_model, bias=config.bias)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.in_proj(x)
        return self.out_proj(self.core(q, k, v, position_ids))
