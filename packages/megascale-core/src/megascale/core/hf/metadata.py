"""What an export needs besides the network: the model family and the token ids.

A GPTConfig says what the network computes, not which Hugging Face family it came from nor which ids its
tokenizer gives the start and end of a document. Without the ids transformers falls back to its class
defaults (Llama: bos 1, eos 2; Qwen2: none), so ``generate`` stops at the wrong token or never. So:

- ``hf_metadata(dir)`` reads them from a Hugging Face directory (config.json's ``model_type`` and
  ``bos/eos/pad_token_id``, and its ``generation_config.json`` when there is one), for a conversion to keep
  with the model (``megascale convert --from-hf`` stores them in its file, a checkpoint trained from
  ``model.pretrained`` finds them there);
- ``infer_model_type(config)`` gives the family when the architecture says it (q/k norms: qwen3; biases on
  q, k, v alone: qwen2; windows on every layer: mistral; none of these: llama, which is also what mistral
  computes without a window; with a mixture of experts: qwen3_moe with q/k norms, mixtral without);
- ``generation_config(...)`` is the ``generation_config.json`` written next to an export.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megascale.core.config import GPTConfig
from megascale.core.hf.config import MODEL_TYPES, hf_config_from_gpt

__all__ = ["GENERATION_CONFIG_FILE", "TOKEN_FIELDS", "generation_config", "hf_metadata", "infer_model_type"]

TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
GENERATION_CONFIG_FILE = "generation_config.json"


def hf_metadata(path: str | Path) -> dict[str, Any]:
    """``{"model_type", "token_ids": {bos/eos/pad_token_id present in config.json}, "generation_config":
    the directory's generation_config.json or None}`` of a Hugging Face model directory (plain JSON values,
    storable anywhere)."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    generation = path / GENERATION_CONFIG_FILE
    return {
        "model_type": config.get("model_type"),
        "token_ids": {key: config[key] for key in TOKEN_FIELDS if key in config},
        "generation_config": json.loads(generation.read_text()) if generation.is_file() else None,
    }


def infer_model_type(config: GPTConfig) -> str:
    """The Hugging Face family that expresses ``config``: the only one that does, or llama when mistral does
    too (no window: both compute the same). ValueError, listing every family's objections, when none can."""
    fits, why = [], []
    for model_type in MODEL_TYPES:
        try:
            hf_config_from_gpt(config, model_type)
        except ValueError as e:
            why.append(str(e))
            continue
        fits.append(model_type)
    if not fits:
        raise ValueError("no Hugging Face family expresses this GPTConfig: " + " | ".join(why))
    return "llama" if "llama" in fits else fits[0]


def generation_config(token_ids: Mapping[str, Any], base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``generation_config.json`` of an export: ``base`` (the source's, if any: its sampling settings and
    ids win, e.g. several eos ids) with the token ids it lacks, as transformers writes one from a config."""
    out: dict[str, Any] = dict(base or {"_from_model_config": True})
    for key in TOKEN_FIELDS:
        if out.get(key) is None and token_ids.get(key) is not None:
            out[key] = token_ids[key]
    return dict(sorted(out.items()))
