"""Model presets for ``megascale plan --model NAME``: published architectures by name, and how a ``--model``
argument (a preset, a GPTConfig YAML, a LightningCLI config, or a Hugging Face config.json) becomes a
``GPTConfig``."""

from __future__ import annotations

import difflib
import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from megascale.core.config import GPTConfig
from megascale.core.plan.published import megatron_2021_table

__all__ = ["PRESETS", "load_model"]

_GPT3 = dict(parallel_block=False, activation="gelu", norm="layernorm", bias=True, max_seq_len=2048)
_LLAMA = dict(parallel_block=False, activation="swiglu", norm="rmsnorm", bias=False)

PRESETS: dict[str, dict[str, Any]] = {
    # Brown et al. 2020, Table 2.1
    "gpt3-175b": dict(vocab_size=50257, d_model=12288, n_layers=96, n_heads=96, **_GPT3),
    "gpt3-13b": dict(vocab_size=50257, d_model=5140, n_layers=40, n_heads=40, **_GPT3),
    # Touvron et al. 2023 (Llama 2) and the Llama 3 model card
    "llama2-7b": dict(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, ffn_hidden=11008,
                      max_seq_len=4096, **_LLAMA),
    "llama2-70b": dict(vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672,
                       max_seq_len=4096, **_LLAMA),
    "llama3-8b": dict(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                      max_seq_len=8192, rope_theta=500000.0, **_LLAMA),
    # Jiang et al. 2024 (Mixtral of Experts) and its config.json: 8 experts of Mistral 7B's MLP, top-2
    "mixtral-8x7b": dict(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                         max_seq_len=32768, rope_theta=1e6, moe=dict(num_experts=8, top_k=2, aux_loss_coef=0.001),
                         **_LLAMA),
}  # fmt: skip
for _row in megatron_2021_table():  # Narayanan et al. 2021, Table 1: "megatron-1.7b" ... "megatron-1008b"
    _name = f"megatron-{_row.params_billion:g}b"
    PRESETS[_name] = {f.name: getattr(_row.workload().model, f.name) for f in fields(GPTConfig)}


def load_model(spec: str) -> GPTConfig:
    """The GPTConfig named by ``spec``: a preset, or a file — a GPTConfig YAML/JSON, a LightningCLI config
    (``model.config``), or a Hugging Face config.json (``model_type``: read by ``megascale.core.hf``)."""
    if spec.lower() in PRESETS:
        return GPTConfig(**PRESETS[spec.lower()])
    path = Path(spec)
    if path.is_dir():
        raise IsADirectoryError(f"--model {spec}: a directory; give its config.json (or a YAML/JSON config)")
    if not path.is_file():
        if "/" in spec or "\\" in spec or path.suffix.lower() in (".json", ".yaml", ".yml"):
            raise FileNotFoundError(f"--model {spec}: no such file")
        close = difflib.get_close_matches(spec.lower(), list(PRESETS), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(
            f"--model {spec!r} is neither a preset nor a file: {hint}presets: {', '.join(sorted(PRESETS))}"
        )
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
    else:
        try:
            import yaml
        except ImportError as e:
            raise ValueError(f"reading {path} needs PyYAML (pip install pyyaml), or give a .json file") from e
        data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a mapping")
    if "model_type" in data:
        from megascale.core.hf.config import gpt_config_from_hf

        return gpt_config_from_hf(data)
    if isinstance(data.get("model"), dict) and isinstance(data["model"].get("config"), dict):
        data = data["model"]["config"]
    known = {f.name for f in fields(GPTConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{path}: {unknown} are not GPTConfig fields (known: {sorted(known)})")
    return GPTConfig(**data)
