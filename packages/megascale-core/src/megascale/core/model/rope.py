"""Rotary position embedding tables, one module shared by every attention layer of a model."""

from __future__ import annotations

import torch
from torch import nn

from megascale.core.config import RopeScaling
from megascale.core.kernels import rope_tables

__all__ = ["RotaryEmbedding"]


class RotaryEmbedding(nn.Module):
    """cos/sin tables (max_seq_len, head_dim/2) as non-persistent buffers (recomputed, never checkpointed).

    One instance is shared by all layers; a pipeline stage keeps it through the blocks it holds.
    """

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(
        self, head_dim: int, max_seq_len: int, theta: float, scaling: RopeScaling | None = None
    ) -> None:
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta, self.scaling = head_dim, max_seq_len, theta, scaling
        cos, sin = rope_tables(max_seq_len, head_dim, theta, scaling=scaling)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def reset_parameters(self) -> None:
        cos, sin = rope_tables(
            self.max_seq_len, self.head_dim, self.theta, device=self.cos.device, scaling=self.scaling
        )
        self.cos.copy_(cos)
        self.sin.copy_(sin)
