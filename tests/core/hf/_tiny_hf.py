"""Tiny random Hugging Face models of each family, saved with transformers' own ``save_pretrained``.

Sizes keep each model's conversion and forward well under a second: width 64, 2 layers, 4 query heads on 2
key/value heads, a vocabulary of 200 (megascale pads it to 256). Norm weights and biases are perturbed away
from transformers' init (ones and zeros), so a norm or bias mapped to the wrong place changes the logits;
weights are drawn with std 0.1 so attention is far from uniform and a wrong rotary angle or window shows.
No eos/bos token: greedy generation then always runs its full length.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
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


def hf_config(family: str, tie: bool, **extra: Any) -> Any:
    cls, kwargs = FAMILIES[family]
    return cls(**COMMON, **kwargs, tie_word_embeddings=tie, **extra)


def tiny_hf_model(family: str, tie: bool, seed: int = 0, **extra: Any) -> Any:
    """A random fp32 ``*ForCausalLM`` of ``family`` in eval mode."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, tie, **extra)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.2 * torch.randn_like(param))
    return model


def save_tiny(family: str, tie: bool, path: Path, **save_kwargs: Any) -> Any:
    """Save a tiny model of ``family`` to ``path`` (transformers' layout); return the model."""
    model = tiny_hf_model(family, tie)
    model.save_pretrained(path, **save_kwargs)
    return model


def tokens(batch: int = 2, length: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
