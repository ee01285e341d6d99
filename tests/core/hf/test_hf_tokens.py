"""What an export carries besides the network: the token ids (config.json and generation_config.json, read
back by transformers) and a family inferred from the architecture when none is given."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig, GenerationConfig

from megascale.core import GPT, GPTConfig
from megascale.core.hf import gpt_config_from_hf, gpt_from_hf, hf_metadata, infer_model_type, save_hf
from tests.core.hf._tiny_hf import FAMILIES, save_tiny


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_family_is_inferred_from_the_architecture(family, tmp_path):
    save_tiny(family, False, tmp_path)
    config = gpt_config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert infer_model_type(config) == family
    save_hf(gpt_from_hf(tmp_path), None, tmp_path / "out")  # no model_type: the inferred one
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == family


def test_a_config_no_family_expresses_is_refused_naming_why():
    config = GPTConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, parallel_block=True)
    with pytest.raises(
        ValueError, match=r"no Hugging Face family expresses this GPTConfig: .*parallel_block"
    ):
        infer_model_type(config)


def test_token_ids_reach_config_and_generation_config(tmp_path):
    save_tiny("qwen2", False, tmp_path / "hf")
    (tmp_path / "hf" / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [151, 152], "temperature": 0.7, "do_sample": True})
    )
    meta = hf_metadata(tmp_path / "hf")
    assert meta["model_type"] == "qwen2" and meta["generation_config"]["temperature"] == 0.7
    ids = {"bos_token_id": 150, "eos_token_id": 151, "pad_token_id": 0}
    save_hf(
        gpt_from_hf(tmp_path / "hf"),
        None,
        tmp_path / "out",
        token_ids=ids,
        generation=meta["generation_config"],
    )
    config = AutoConfig.from_pretrained(tmp_path / "out")
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (150, 151, 0)
    generation = GenerationConfig.from_pretrained(tmp_path / "out")
    assert (
        generation.eos_token_id == [151, 152] and generation.temperature == 0.7
    )  # the source's settings win
    assert generation.bos_token_id == 150 and generation.pad_token_id == 0  # ids it lacked come from the ids


def test_unknown_token_ids_are_null_not_the_class_defaults(tmp_path):
    config = GPTConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, parallel_block=False,
                       norm="rmsnorm", activation="swiglu")  # fmt: skip
    save_hf(GPT(config), None, tmp_path)  # a llama
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert loaded.model_type == "llama"
    assert loaded.eos_token_id is None and loaded.bos_token_id is None  # not LlamaConfig's 2 and 1
    assert GenerationConfig.from_pretrained(tmp_path).eos_token_id is None
