"""config.json ↔ GPTConfig: both spellings of the rotary settings, per-layer windows, defaults of absent
fields, overrides, and the config transformers writes for each family."""

from __future__ import annotations

import pytest

from megascale.core import GPTConfig
from megascale.core.config import MoEConfig, RopeScaling
from megascale.core.hf import MODEL_TYPES, gpt_config_from_hf, hf_config_from_gpt

BASE = dict(
    vocab_size=100,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)
SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def test_both_spellings_of_the_rope_settings_give_one_config():
    v4 = gpt_config_from_hf(
        {
            **BASE,
            "model_type": "llama",
            "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", **SCALING},
        }
    )
    v5 = gpt_config_from_hf(
        {
            **BASE,
            "model_type": "llama",
            "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **SCALING},
        }
    )
    old_key = gpt_config_from_hf(
        {**BASE, "model_type": "llama", "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **SCALING}}
    )
    assert v4 == v5 == old_key
    assert v4.rope_theta == 500000.0
    assert v4.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    plain = gpt_config_from_hf({**BASE, "model_type": "llama", "rope_parameters": {"rope_type": "default"}})
    assert plain.rope_scaling is None and plain.rope_theta == 10000.0


def test_absent_fields_take_transformers_defaults_and_nulls_mean_what_transformers_makes_of_them():
    sizes = dict(
        vocab_size=100, hidden_size=1024, intermediate_size=48, num_hidden_layers=2, num_attention_heads=32
    )
    qwen3 = gpt_config_from_hf({**sizes, "model_type": "qwen3"})
    assert qwen3.head_dim == 128 and qwen3.kv_heads == 32 and qwen3.max_seq_len == 32768
    assert qwen3.norm_eps == 1e-6 and qwen3.qk_norm and qwen3.sliding_window is None
    nulls = gpt_config_from_hf(
        {**sizes, "model_type": "qwen3", "head_dim": None, "num_key_value_heads": None}
    )
    assert nulls.head_dim == 32 and nulls.head_size is None and nulls.kv_heads == 32
    mistral = gpt_config_from_hf({**sizes, "model_type": "mistral"})
    assert mistral.sliding_window == 4096 and mistral.kv_heads == 8 and mistral.head_dim == 32
    assert (
        gpt_config_from_hf({**sizes, "model_type": "mistral", "sliding_window": None}).sliding_window is None
    )
    llama = gpt_config_from_hf({**sizes, "model_type": "llama"})
    assert llama.kv_heads == 32 and llama.max_seq_len == 2048 and not llama.tie_embeddings


@pytest.mark.parametrize(
    ("fields", "window", "every"),
    [
        (dict(use_sliding_window=False, sliding_window=16, max_window_layers=0), None, None),
        (dict(use_sliding_window=True, sliding_window=16, max_window_layers=0), 16, None),
        (dict(use_sliding_window=True, sliding_window=16, max_window_layers=4), None, None),  # all below it
        (
            dict(
                use_sliding_window=True,
                sliding_window=16,
                layer_types=["sliding_attention", "full_attention"] * 2,
            ),
            16,
            2,
        ),
        (
            dict(
                use_sliding_window=True,
                sliding_window=16,
                layer_types=["sliding_attention"] * 3 + ["full_attention"],
            ),
            16,
            4,
        ),
    ],
)
def test_qwen_per_layer_windows(fields, window, every):
    config = gpt_config_from_hf({**BASE, "model_type": "qwen2", **fields})
    assert (config.sliding_window, config.full_attention_every) == (window, every)


def test_a_window_pattern_gptconfig_cannot_express_is_refused():
    with pytest.raises(ValueError, match=r"full attention to layers \[0\].*full_attention_every"):
        gpt_config_from_hf({**BASE, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16,
                            "max_window_layers": 1})  # fmt: skip


def test_overrides_are_limited_to_what_does_not_change_the_network():
    config = gpt_config_from_hf({**BASE, "model_type": "llama"}, max_seq_len=64, pad_vocab_to_multiple_of=64)
    assert config.max_seq_len == 64 and config.padded_vocab_size == 128
    with pytest.raises(ValueError, match=r"cannot override \['n_layers'\]"):
        gpt_config_from_hf({**BASE, "model_type": "llama"}, n_layers=2)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_export_then_import_gives_the_same_config(model_type):
    options = {
        "llama": dict(bias=True, rope_scaling=RopeScaling(4.0, 1.0, 4.0, 32)),
        "qwen2": dict(qkv_bias=True, sliding_window=8, full_attention_every=2),
        "qwen3": dict(qk_norm=True, head_size=16, tie_embeddings=True),
        "mistral": dict(sliding_window=8, n_kv_heads=1),
        "mixtral": dict(sliding_window=8, rope_theta=1e6, moe=MoEConfig(8, 2, expert_hidden=48)),
        "qwen3_moe": dict(
            qk_norm=True,
            head_size=16,
            bias=True,
            sliding_window=8,
            moe=MoEConfig(8, 4, expert_hidden=24, normalize_top_k=False, aux_loss_coef=0.001),
        ),
    }[model_type]
    config = GPTConfig(vocab_size=100, d_model=32, n_layers=4, n_heads=4, ffn_hidden=48, max_seq_len=64,
                       parallel_block=False, norm_eps=1e-6, **options)  # fmt: skip
    exported = hf_config_from_gpt(config, model_type)
    assert exported["model_type"] == model_type and exported["architectures"][0].endswith("ForCausalLM")
    assert gpt_config_from_hf(exported) == config
