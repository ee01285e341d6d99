"""Tiny random Hugging Face models of each family, saved with transformers' own ``save_pretrained``.

Sizes keep each model's conversion and forward well under a second: width 64, 2 layers, 4 query heads on 2
key/value heads, a vocabulary of 200 (megascale pads it to 256). Norm weights and biases are perturbed away
from transformers' init (ones and zeros), so a norm or bias mapped to the wrong place changes the logits;
weights are drawn with std 0.1 so attention is far from uniform and a wrong rotary angle or window shows.
No eos/bos token: greedy generation then always runs its full length.

The mixtures of experts (``MOE_FAMILIES``) have the same sizes, 4 experts of which each token takes 2: a tiny
Mixtral (experts 96 wide, a window of 8) and a tiny Qwen3-MoE (experts 48 wide, q/k norms, heads 32 wide).
Their routers are drawn with std 0.1 like every weight, so the top-2 choice has no ties.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers.utils import logging

logging.set_verbosity_error()

VOCAB = 200
COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=128,
    initializer_range=0.1,
    rms_norm_eps=1e-5,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
# Llama 3.1's rope scaling with the original context cut to 64: of the head's 8 frequencies one is kept, one
# interpolated and six slowed down (wavelengths 6.3, 32, 167, ... against bounds 16 and 64).
LLAMA3_SCALING = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)
FAMILIES: dict[str, tuple[type, dict[str, Any]]] = {
    "llama": (LlamaConfig, dict(rope_theta=500000.0, rope_scaling=LLAMA3_SCALING)),
    "qwen2": (Qwen2Config, dict(rope_theta=1000000.0)),  # q, k, v biases
    "qwen3": (Qwen3Config, dict(head_dim=32)),  # q/k norms; 4 heads x 32 = 128 != hidden 64
    "mistral": (MistralConfig, dict(sliding_window=8)),  # windows shorter than the test sequences
}
MOE: dict[str, Any] = dict(num_experts_per_tok=2, router_aux_loss_coef=0.02)
MOE_FAMILIES: dict[str, tuple[type, dict[str, Any]]] = {
    "mixtral": (MixtralConfig, dict(**MOE, num_local_experts=4, sliding_window=8, rope_theta=1000000.0)),
    "qwen3_moe": (Qwen3MoeConfig, dict(**MOE, num_experts=4, moe_intermediate_size=48, head_dim=32)),
}


def hf_config(family: str, tie: bool, **extra: Any) -> Any:
    cls, kwargs = {**FAMILIES, **MOE_FAMILIES}[family]
    return cls(**COMMON, **kwargs, tie_word_embeddings=tie, **extra)


def tiny_hf_model(family: str, tie: bool, seed: int = 0, **extra: Any) -> Any:
    """A random fp32 ``*ForCausalLM`` of ``family`` in eval mode."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, tie, **extra)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.2 * torch.randn_like(param))
            elif name.endswith("mlp.gate.weight"):  # a router (transformers may start it at zero)
                param.copy_(COMMON["initializer_range"] * torch.randn_like(param))
    return model


def save_tiny(
    family: str, tie: bool, path: Path, config: dict[str, Any] | None = None, **save_kwargs: Any
) -> Any:
    """Save a tiny model of ``family`` (``config``: changes to its config) to ``path`` (transformers' layout);
    return the model."""
    model = tiny_hf_model(family, tie, **(config or {}))
    model.save_pretrained(path, **save_kwargs)
    return model


def tokens(batch: int = 2, length: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
