"""The GPT model, built from small modules that read like the papers."""

from megascale.core.model.attention import Attention, SelfAttention
from megascale.core.model.block import ParallelBlock, SequentialBlock, make_block
from megascale.core.model.generate import generate
from megascale.core.model.gpt import GPT, LMHead, NextTokenLoss, TokenEmbedding, flops_per_token
from megascale.core.model.layers import PipelineLayers, pipeline_layers_of
from megascale.core.model.linear import FanInLinear, FanOutLinear, Projection
from megascale.core.model.mlp import MLP, MLPActivation
from megascale.core.model.moe import GroupedExperts, MoE, take_balancing_losses
from megascale.core.model.norm import LayerNorm, RMSNorm, make_norm
from megascale.core.model.rope import RotaryEmbedding

__all__ = [
    "GPT",
    "MLP",
    "Attention",
    "FanInLinear",
    "FanOutLinear",
    "GroupedExperts",
    "LMHead",
    "LayerNorm",
    "MLPActivation",
    "MoE",
    "NextTokenLoss",
    "ParallelBlock",
    "PipelineLayers",
    "Projection",
    "RMSNorm",
    "RotaryEmbedding",
    "SelfAttention",
    "SequentialBlock",
    "TokenEmbedding",
    "flops_per_token",
    "generate",
    "make_block",
    "make_norm",
    "pipeline_layers_of",
    "take_balancing_losses",
]
