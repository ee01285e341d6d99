"""Whole conversions: a Hugging Face model directory → megascale state dict or GPT, and back."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from megascale.core.config import GPTConfig
from megascale.core.hf.config import gpt_config_from_hf, hf_config_from_gpt
from megascale.core.hf.io import HFCheckpoint, dtype_name, write_config, write_safetensors
from megascale.core.hf.metadata import (
    GENERATION_CONFIG_FILE,
    TOKEN_FIELDS,
    generation_config,
    infer_model_type,
)
from megascale.core.hf.weights import from_hf_tensors, to_hf_tensors
from megascale.core.model.gpt import GPT
from megascale.core.model.moe import moe_layers

__all__ = ["gpt_from_hf", "load_hf_state_dict", "save_hf"]


def load_hf_state_dict(
    path: str | Path, config: GPTConfig | None = None, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The state dict of megascale's GPT (its parameter names, vocabulary padded with zero rows) from the
    Hugging Face model directory ``path``.

    Args:
        config: the GPTConfig the tensors are for; default ``gpt_config_from_hf`` of the directory's
            config.json (give one to choose e.g. ``pad_vocab_to_multiple_of``).
        dtype: cast every tensor to it; default as stored.

    Raises:
        FileNotFoundError, KeyError, ValueError: naming the missing file or tensor, the mismatched shape, or
            the config.json field (see ``HFCheckpoint``, ``from_hf_tensors``, ``gpt_config_from_hf``).
    """
    with HFCheckpoint(path) as checkpoint:
        if config is None:
            config = gpt_config_from_hf(checkpoint.config)

        def read(name: str) -> torch.Tensor:
            tensor = checkpoint.read(name)
            return tensor if dtype is None else tensor.to(dtype)

        return from_hf_tensors(config, checkpoint.keys(), checkpoint.shape, read)


def gpt_from_hf(
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    **overrides: Any,
) -> GPT:
    """megascale's GPT computing what transformers' model in ``path`` computes (its logits equal within
    float rounding), on ``device``.

    Args:
        dtype: of the parameters; default as stored (rotary tables stay fp32).
        overrides: GPTConfig fields that do not change the network (``max_seq_len``,
            ``pad_vocab_to_multiple_of``, ``kernels``, ``dropout``, ``init_std``): see ``gpt_config_from_hf``.
    """
    with HFCheckpoint(path) as checkpoint:
        config = gpt_config_from_hf(checkpoint.config, **overrides)
    state = load_hf_state_dict(path, config, dtype)
    with torch.device("meta"):
        model = GPT(config)
    model.load_state_dict({k: v.to(device) for k, v in state.items()}, assign=True, strict=True)
    model.rope.to_empty(device=device)
    model.rope.reset_parameters()
    for layer in moe_layers(model):  # the routers' token counts (not saved) are still on the meta device
        router = layer.router
        router.tokens_per_expert = torch.zeros_like(router.tokens_per_expert, device=device)
    return model


def save_hf(
    model_or_state_dict: GPT | Mapping[str, torch.Tensor],
    config: GPTConfig | None,
    path: str | Path,
    model_type: str | None = None,
    *,
    max_shard_size: int | str = "5GB",
    token_ids: Mapping[str, Any] | None = None,
    generation: Mapping[str, Any] | None = None,
) -> list[Path]:
    """Write a Hugging Face model directory (config.json, generation_config.json and safetensors) that
    transformers' ``AutoModelForCausalLM.from_pretrained(path)`` loads as the ``model_type`` model computing
    what this GPT computes. Tokenizer files are not written: copy them from where the model came from.

    Args:
        model_or_state_dict: a GPT on one process, or its state dict (megascale names).
        config: the GPTConfig; None takes a GPT's own.
        model_type: llama, qwen2, qwen3, mistral, mixtral or qwen3_moe; must express the architecture
            (``hf_config_from_gpt``).
            None: the family the architecture implies (``infer_model_type``).
        max_shard_size: bytes per safetensors file (int, or "5GB", "500MB"...); past it the tensors are
            sharded with an index.
        token_ids: ``bos_token_id``, ``eos_token_id``, ``pad_token_id`` of the tokenizer (``hf_metadata`` of
            the source). Those not given are written as null, so transformers does not fall back to its
            class defaults (Llama's eos 2) for a tokenizer that has other ids.
        generation: the source's generation_config.json (its settings and ids are kept), if any.

    Returns:
        The files written.
    """
    if isinstance(model_or_state_dict, GPT):
        config = model_or_state_dict.config if config is None else config
        state: Mapping[str, torch.Tensor] = model_or_state_dict.state_dict()
    else:
        state = model_or_state_dict
    if config is None:
        raise ValueError("save_hf needs the GPTConfig of a state dict (config=...)")
    hf_config = hf_config_from_gpt(config, model_type or infer_model_type(config))
    token_ids = dict(token_ids or {})
    hf_config.update({key: token_ids.get(key) for key in TOKEN_FIELDS})
    tensors = to_hf_tensors(state, config)
    hf_config["torch_dtype"] = dtype_name(tensors["model.embed_tokens.weight"].dtype)
    files = write_safetensors(tensors, path, max_shard_size)
    generation_file = Path(path) / GENERATION_CONFIG_FILE
    generation_file.write_text(json.dumps(generation_config(token_ids, generation), indent=2) + "\n")
    return [write_config(hf_config, path), generation_file, *files]
