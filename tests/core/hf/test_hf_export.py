"""Export: Hugging Face → megascale → Hugging Face gives back every tensor bit for bit, and transformers loads
the export as the model it was; safetensors sharded by an index are read and written; reads are lazy."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from megascale.core import GPT, GPTConfig
from megascale.core.hf import (
    HFCheckpoint,
    gpt_config_from_hf,
    gpt_from_hf,
    hf_config_from_gpt,
    load_hf_state_dict,
    save_hf,
)
from tests.core.hf._tiny_hf import FAMILIES, VOCAB, save_tiny, tokens


def _tensors(path) -> dict[str, torch.Tensor]:
    with HFCheckpoint(path) as checkpoint:
        return {name: checkpoint.read(name) for name in checkpoint}


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_round_trip_is_bitwise_and_transformers_loads_the_export(family, tie, tmp_path):
    hf = save_tiny(family, tie, tmp_path / "hf")
    model = gpt_from_hf(tmp_path / "hf")
    save_hf(model, None, tmp_path / "out", model_type=family)

    original, exported = _tensors(tmp_path / "hf"), _tensors(tmp_path / "out")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    # the config says the same model: it converts back to the same GPTConfig
    in_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    out_config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert gpt_config_from_hf(out_config) == gpt_config_from_hf(in_config) == model.config
    assert out_config["torch_dtype"] == "float32"

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(reloaded) is type(hf)
    x = tokens()
    with torch.no_grad():
        assert (reloaded(x).logits - hf(x).logits).abs().max().item() <= 1e-5


def test_sharded_checkpoints_both_ways(tmp_path):
    hf = save_tiny("qwen3", False, tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    model = gpt_from_hf(tmp_path / "hf")

    files = save_hf(model, None, tmp_path / "out", "qwen3", max_shard_size="20KB")
    shards = sorted(p.name for p in (tmp_path / "out").glob("model-*-of-*.safetensors"))
    assert len(shards) > 3 and all(p.exists() for p in files)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in _tensors(tmp_path / "hf").values())
    for shard in shards:  # no shard over the limit unless it holds one tensor
        with safe_open(tmp_path / "out" / shard, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            sizes = [f.get_tensor(k).numel() * 4 for k in f.keys()]  # noqa: SIM118 (safe_open is no dict)
        assert sum(sizes) <= 20_000 or len(sizes) == 1

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    x = tokens()
    with torch.no_grad():
        assert torch.equal(reloaded(x).logits, hf(x).logits)
    # a smaller export into the same directory leaves no stale shard behind
    save_hf(model, None, tmp_path / "out", "qwen3")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]


def test_tensors_and_slices_are_read_lazily(tmp_path):
    save_tiny("llama", False, tmp_path, max_shard_size="20KB")
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    with HFCheckpoint(tmp_path) as checkpoint:
        # shards are opened when a tensor in them is asked for: one removed now is never missed
        (tmp_path / weight_map["model.layers.1.mlp.down_proj.weight"]).unlink()
        assert checkpoint.config["model_type"] == "llama"
        assert checkpoint.shape("model.embed_tokens.weight") == (VOCAB, 64)
        full = checkpoint.read("lm_head.weight")
        assert torch.equal(checkpoint.read("lm_head.weight", slice(10, 20)), full[10:20])
        assert torch.equal(checkpoint.read("lm_head.weight", (slice(None), slice(0, 8))), full[:, :8])


def test_vocabulary_padding_is_zero_rows_on_import_and_dropped_on_export(tmp_path):
    save_tiny("mistral", False, tmp_path / "hf")
    config = gpt_config_from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()),
                                pad_vocab_to_multiple_of=96)  # fmt: skip
    state = load_hf_state_dict(tmp_path / "hf", config)
    assert config.padded_vocab_size == 288
    for name in ("embed.weight", "head.proj.logits.weight"):
        assert state[name].shape == (288, 64) and not state[name][VOCAB:].any()
    save_hf(state, config, tmp_path / "out", "mistral")
    assert _tensors(tmp_path / "out")["lm_head.weight"].shape == (VOCAB, 64)


def test_a_trained_megascale_model_exports_and_transformers_agrees(tmp_path):
    """The other direction: a GPT made here (every HF-compatible option on) becomes a transformers model."""
    config = GPTConfig(vocab_size=150, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, head_size=16,
                       ffn_hidden=80, max_seq_len=64, parallel_block=False, qk_norm=True, sliding_window=6,
                       full_attention_every=2, rope_theta=50000.0, init_std=0.1,
                       rope_scaling=dict(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_seq_len=32))  # fmt: skip
    torch.manual_seed(0)
    model = GPT(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    save_hf(model, None, tmp_path, "qwen3", max_shard_size=10_000)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x = torch.randint(0, 150, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (hf(x).logits - model(x)[..., :150]).abs().max().item() <= 1e-5
    assert hf_config_from_gpt(config, "qwen3")["layer_types"] == ["sliding_attention", "full_attention"]


def test_weights_that_are_views_of_one_buffer_are_written(tmp_path):
    """Under ZeRO-1 (its default element sharding) a live model's parameters are views of flat buckets;
    safetensors refuses tensors that share storage, so the writer copies them out."""
    from megascale.core.hf.io import write_safetensors

    flat = torch.arange(10.0)
    write_safetensors({"a": flat[:4].view(2, 2), "b": flat[4:]}, tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        written = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    assert torch.equal(written["a"], flat[:4].view(2, 2)) and torch.equal(written["b"], flat[4:])
