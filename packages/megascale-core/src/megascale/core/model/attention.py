"""Self-attention: the projection-free core (rotary + softmax attention) and the sequential-block layer.

The core reads its head counts from the shapes it is given, so after tensor parallelism splits the heads it
simply sees fewer of them. Selective activation checkpointing recomputes this core alone.
"""

from __future__ import annotations

import torch
from torch import nn

from megascale.core import kernels
from megascale.core.config import GPTConfig
from megascale.core.model.linear import FanInLinear, FanOutLinear
from megascale.core.model.rope import RotaryEmbedding

__all__ = ["Attention", "SelfAttention", "qkv_features"]


def qkv_features(config: GPTConfig) -> dict[str, int]:
    return {
        "q": config.n_heads * config.head_dim,
        "k": config.kv_heads * config.head_dim,
        "v": config.kv_heads * config.head_dim,
    }


class SelfAttention(nn.Module):
    """softmax(rope(q) rope(k)^T / sqrt(hd) + causal/window mask) v, on (B, T, heads·hd) projections."""

    def __init__(self, config: GPTConfig, rope: RotaryEmbedding, window: int | None) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.window = window
        self.dropout = config.dropout
        self.rope = rope
        self.rope_backend = config.kernels.get("rope")
        self.attention_backend = config.kernels.get("attention")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, T, _ = q.shape
        q = q.view(B, T, -1, self.head_dim)  # (B, T, H, hd)
        k = k.view(B, T, -1, self.head_dim)  # (B, T, KV, hd)
        v = v.view(B, T, -1, self.head_dim)
        q = kernels.apply_rope(q, self.rope.cos, self.rope.sin, backend=self.rope_backend)
        k = kernels.apply_rope(k, self.rope.cos, self.rope.sin, backend=self.rope_backend)
        y = kernels.attention(
            q,
            k,
            v,
            window=self.window,
            dropout_p=self.dropout if self.training else 0.0,
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
        self.in_proj = FanOutLinear(config.d_model, qkv, bias=config.bias)
        self.core = SelfAttention(config, rope, window)
        self.out_proj = FanInLinear({"o": qkv["q"]}, config.d_model, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.in_proj(x)
        return self.out_proj(self.core(q, k, v))
