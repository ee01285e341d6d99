"""Transformer blocks: the parallel block (MegaScale, PaLM, GPT-J) and the sequential pre-norm block.

Parallel:   y = x + Attn(N(x)) + MLP(N(x))        one norm; Q, K, V, gate, up read it together, and
                                                   the attention and MLP outputs are summed by one projection
Sequential: h = x + Attn(N1(x));  y = h + MLP(N2(h))

Both take the batch's ``position_ids`` for packed documents (``SelfAttention``), None otherwise.

With a mixture of experts (``GPTConfig.moe``) the MoE layer takes the MLP's place; in the parallel block it
reads the shared norm beside attention and its output is added to the attention projection's.
"""

from __future__ import annotations

import torch
from torch import nn

from megascale.core.config import GPTConfig
from megascale.core.model.attention import Attention, SelfAttention, qkv_bias_names, qkv_features
from megascale.core.model.linear import FanInLinear, FanOutLinear
from megascale.core.model.mlp import MLP, MLPActivation, fused_bias_names, mlp_features
from megascale.core.model.moe import MoE
from megascale.core.model.norm import make_norm
from megascale.core.model.rope import RotaryEmbedding

__all__ = ["ParallelBlock", "SequentialBlock", "make_block"]


class ParallelBlock(nn.Module):
    moe: MoE | None

    def __init__(self, config: GPTConfig, rope: RotaryEmbedding, window: int | None) -> None:
        super().__init__()
        qkv = qkv_features(config)
        mlp = mlp_features(config) if config.moe is None else {}
        self.norm = make_norm(config)
        biased = [*qkv, *mlp] if config.bias else qkv_bias_names(config)
        fused = fused_bias_names(config) if mlp else ()
        self.in_proj = FanOutLinear(config.d_model, {**qkv, **mlp}, biased, fused)
        self.attn = SelfAttention(config, rope, window)
        self.act = MLPActivation(config) if mlp else None
        down = {"down": config.ffn_dim} if mlp else {}
        self.out_proj = FanInLinear({"o": qkv["q"], **down}, config.d_model, config.bias)
        self.moe = MoE(config) if config.moe is not None else None
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = self.norm(x)
        q, k, v, *mlp_in = self.in_proj(h)
        if self.moe is not None:
            return x + self.dropout(self.out_proj(self.attn(q, k, v, position_ids)) + self.moe(h))
        assert self.act is not None
        return x + self.dropout(
            self.out_proj(self.attn(q, k, v, position_ids), self.act(self.in_proj, *mlp_in))
        )


class SequentialBlock(nn.Module):
    def __init__(self, config: GPTConfig, rope: RotaryEmbedding, window: int | None) -> None:
        super().__init__()
        self.attn_norm = make_norm(config)
        self.attn = Attention(config, rope, window)
        self.mlp_norm = make_norm(config)
        self.mlp = MLP(config) if config.moe is None else MoE(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), position_ids))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


def make_block(config: GPTConfig, rope: RotaryEmbedding, layer: int) -> ParallelBlock | SequentialBlock:
    cls = ParallelBlock if config.parallel_block else SequentialBlock
    return cls(config, rope, config.window_for_layer(layer))
