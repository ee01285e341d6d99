"""GPTConfig validates the architecture and says what to change; check_tensor_parallel does the same for tp."""

import pytest

from megascale.core import GPTConfig
from megascale.core.config import RopeScaling


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(d_model=100, n_heads=3), "d_model=100 is not divisible by n_heads=3"),
        (dict(d_model=96, n_heads=32), "head_dim = d_model/n_heads = 3 must be even"),
        (dict(n_heads=12, n_kv_heads=5), "n_heads=12 is not divisible by n_kv_heads=5"),
        (dict(n_kv_heads=0), "n_kv_heads=0"),
        (dict(vocab_size=0), "vocab_size=0 must be >= 1"),
        (dict(n_layers=0), "n_layers=0 must be >= 1"),
        (dict(ffn_hidden=0), "ffn_hidden=0 must be >= 1"),
        (dict(norm="batchnorm"), "norm='batchnorm'"),
        (dict(activation="relu"), "activation='relu'"),
        (dict(sliding_window=0), "sliding_window=0 must be >= 1"),
        (dict(full_attention_every=2), "full_attention_every needs a sliding_window"),
        (dict(dropout=1.0), "dropout=1.0 must be in [0, 1)"),
        (dict(init_std=0.0), "must be > 0"),
        (dict(kernels={"attn": "sdpa"}), "unknown kernels ['attn']"),
        (dict(head_size=7), "head_size=7 must be even"),
        (dict(rope_scaling={"factor": 8.0, "scale": 2}), "rope_scaling has unknown keys ['scale']"),
    ],
)
def test_invalid_configs_are_rejected_with_a_message(kwargs, message):
    with pytest.raises(ValueError, match="invalid GPTConfig") as info:
        GPTConfig(**kwargs)
    assert message in str(info.value)


def test_defaults_and_derived_sizes():
    cfg = GPTConfig(vocab_size=50257, d_model=768, n_heads=12)
    assert cfg.head_dim == 64
    assert cfg.kv_heads == 12
    assert cfg.padded_vocab_size == 50304  # 393 × 128
    assert cfg.ffn_dim == 2048  # ⅔ · 4 · 768 = 2048, already a multiple of 256
    assert GPTConfig(d_model=768, activation="gelu").ffn_dim == 3072
    assert GPTConfig(d_model=64, n_heads=4, ffn_hidden=100).ffn_dim == 100


def test_head_size_sets_the_attention_width_apart_from_d_model():
    cfg = GPTConfig(d_model=100, n_heads=3, head_size=32)  # 100 is not divisible by 3: fine with head_size
    assert cfg.head_dim == 32
    assert GPTConfig(d_model=64, n_heads=4).head_dim == 16


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(factor=0.0), "factor=0.0 must be > 0"),
        (dict(low_freq_factor=4.0, high_freq_factor=1.0), "0 < low_freq_factor < high_freq_factor"),
        (dict(original_max_seq_len=0), "original_max_seq_len=0 must be >= 1"),
        (dict(kind="yarn"), "kind='yarn' is not a known rope scaling"),
    ],
)
def test_invalid_rope_scaling_is_rejected(kwargs, message):
    good = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)
    with pytest.raises(ValueError, match="invalid RopeScaling") as info:
        GPTConfig(rope_scaling={**good, **kwargs})
    assert message in str(info.value)


def test_rope_scaling_survives_to_dict_as_a_plain_dict():
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)
    cfg = GPTConfig(rope_scaling=scaling)
    saved = cfg.to_dict()
    assert saved["rope_scaling"] == dict(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192, kind="llama3"
    )
    assert GPTConfig(**saved) == cfg and GPTConfig(**saved).rope_scaling == scaling


def test_window_per_layer():
    cfg = GPTConfig(n_layers=6, sliding_window=128, full_attention_every=3)
    assert [cfg.window_for_layer(i) for i in range(6)] == [128, 128, None, 128, 128, None]
    assert GPTConfig(n_layers=2, sliding_window=8).window_for_layer(1) == 8
    assert GPTConfig().window_for_layer(0) is None


@pytest.mark.parametrize(
    ("kwargs", "tp", "message"),
    [
        (dict(d_model=96, n_heads=6, n_kv_heads=6), 4, "n_heads=6 is not divisible by tp=4"),
        (dict(n_heads=8, n_kv_heads=2), 4, "n_kv_heads=2 is not divisible by tp=4"),
        (
            dict(d_model=64, n_heads=4, ffn_hidden=102),
            4,
            "MLP width 102 is not divisible by tp=4; set ffn_hidden",
        ),
        (
            dict(d_model=48, n_heads=3, vocab_size=100, pad_vocab_to_multiple_of=10),
            3,
            "padded vocabulary 100 is not divisible by tp=3; set pad_vocab_to_multiple_of to a multiple of 3",
        ),
        (dict(), 0, "tp=0 must be >= 1"),
    ],
)
def test_tensor_parallel_size_is_checked_against_the_model(kwargs, tp, message):
    cfg = GPTConfig(**kwargs)
    with pytest.raises(ValueError, match="tp=") as info:
        cfg.check_tensor_parallel(tp)
    assert message in str(info.value)


def test_indivisible_vocabulary_is_padded_not_rejected():
    cfg = GPTConfig(vocab_size=50257, d_model=64, n_heads=8, ffn_hidden=256)
    for tp in (1, 2, 4, 8):
        cfg.check_tensor_parallel(tp)
    assert cfg.padded_vocab_size % 8 == 0 and cfg.padded_vocab_size >= cfg.vocab_size


def test_tensor_parallel_error_lists_sizes_that_fit():
    cfg = GPTConfig(d_model=96, n_heads=6, n_kv_heads=6, ffn_hidden=384)
    with pytest.raises(ValueError, match=r"Tensor parallel sizes that fit it: \[1, 2, 3, 6\]"):
        cfg.check_tensor_parallel(4)
