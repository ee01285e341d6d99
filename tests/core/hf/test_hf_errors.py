"""Bad input is refused with an error that names the problem: the model type, the config.json field, the
missing shard file, the tensor and both shapes, the missing tensor; and exports a family cannot express."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megascale.core import GPT, GPTConfig, _optional
from megascale.core.hf import gpt_config_from_hf, gpt_from_hf, hf_config_from_gpt, load_hf_state_dict, save_hf

LLAMA = GPTConfig(vocab_size=100, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48,
                  max_seq_len=32, parallel_block=False)  # fmt: skip


def _export(path: Path, **save_kwargs) -> dict:
    torch.manual_seed(0)
    save_hf(GPT(LLAMA), None, path, "llama", **save_kwargs)
    return json.loads((path / "config.json").read_text())


def _rewrite_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_unknown_model_type_names_it_and_the_supported_ones(tmp_path):
    config = _export(tmp_path)
    with pytest.raises(
        ValueError, match=r"model_type 'gpt2' is not supported; .*llama, qwen2, qwen3, mistral"
    ):
        gpt_config_from_hf({**config, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="model_type 'falcon' is not supported"):
        hf_config_from_gpt(LLAMA, "falcon")
    _rewrite_config(tmp_path, model_type="gemma")
    with pytest.raises(ValueError, match="'gemma'"):
        gpt_from_hf(tmp_path)


def test_an_unknown_config_field_is_named(tmp_path):
    config = _export(tmp_path)
    with pytest.raises(ValueError, match=r"\['quantization_config'\]"):
        gpt_config_from_hf({**config, "quantization_config": {"bits": 4}})
    with pytest.raises(ValueError, match=r"\['use_sliding_window'\]"):  # a qwen2 field in a llama config
        gpt_config_from_hf({**config, "use_sliding_window": False})
    with pytest.raises(ValueError, match=r"rope_scaling with field\(s\) \['mscale'\]"):
        gpt_config_from_hf({**config, "rope_scaling": {"rope_type": "llama3", "mscale": 1.0}})
    # fields that do not change the network are accepted
    gpt_config_from_hf({**config, "bos_token_id": 1, "torch_dtype": "bfloat16", "_name_or_path": "x"})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(attention_dropout=0.1), "attention_dropout=0.1"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type='yarn'"),
        (dict(attention_bias=True, mlp_bias=False), "attention_bias=True and mlp_bias=False"),
        (dict(num_hidden_layers=None), r"lacks the required field\(s\) \['num_hidden_layers'\]"),
    ],
)
def test_values_megascale_cannot_compute_are_named(change, message, tmp_path):
    config = _export(tmp_path)
    with pytest.raises(ValueError, match=message):
        gpt_config_from_hf({**config, **change})


def test_a_missing_shard_names_the_file(tmp_path):
    _export(tmp_path, max_shard_size="4KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"shard {shard.name} listed in model.safetensors.index.json"):
        load_hf_state_dict(tmp_path)


def test_no_safetensors_at_all_says_what_is_there(tmp_path):
    _export(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"neither model.safetensors .*pytorch_model.bin"):
        gpt_from_hf(tmp_path)


def test_a_wrong_shape_names_the_tensor_and_both_shapes(tmp_path):
    _export(tmp_path)
    _rewrite_config(tmp_path, intermediate_size=64)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_proj.weight has shape \[48, 32\], but "
                                         r"config.json implies \[64, 32\]"):  # fmt: skip
        load_hf_state_dict(tmp_path)


def test_a_missing_tensor_is_named(tmp_path):
    _export(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"no tensor model.layers.1.self_attn.k_proj.weight"):
        gpt_from_hf(tmp_path)


def test_a_tensor_without_a_place_is_named(tmp_path):
    _export(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)  # a Qwen3 tensor in a llama
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"no place for: \['model.layers.0.self_attn.q_norm.weight'\]"):
        gpt_from_hf(tmp_path)


@pytest.mark.parametrize(
    ("model_type", "change", "message"),
    [
        ("llama", dict(parallel_block=True), "parallel_block=True"),
        ("llama", dict(sliding_window=8), "sliding_window=8"),
        ("llama", dict(qkv_bias=True), "qkv_bias=True"),
        ("qwen2", dict(), "qwen2 has biases on q, k, v only"),
        ("qwen3", dict(), "qk_norm=False"),
        ("mistral", dict(sliding_window=8, full_attention_every=2), "full_attention_every=2"),
        ("llama", dict(norm="layernorm"), "norm='layernorm'"),
    ],
)
def test_an_export_the_family_cannot_express_names_the_option(model_type, change, message, tmp_path):
    config = GPTConfig(**{**LLAMA.to_dict(), **change})
    with pytest.raises(ValueError, match=message):
        save_hf(GPT(config), None, tmp_path, model_type)
    assert not (tmp_path / "config.json").exists()


def test_without_safetensors_the_error_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "safetensors", None)  # import safetensors now fails
    _optional._probe.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"needs safetensors: .*pip install 'megascale-core\[hf\]'"):
            save_hf(GPT(LLAMA), None, tmp_path, "llama")
    finally:
        _optional._probe.cache_clear()
