"""The GPT on one process: shapes, causality, sliding windows, padding, init, tying, FLOPs and sampling."""

import math

import pytest
import torch

from megascale.core import GPT, GPTConfig, flops_per_token, generate

TINY = dict(vocab_size=100, d_model=32, n_layers=2, n_heads=4, max_seq_len=32, pad_vocab_to_multiple_of=64)


def _model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, **overrides}))


@pytest.mark.parametrize("parallel_block", [True, False])
def test_logits_shape_and_initial_loss(parallel_block):
    model = _model(parallel_block=parallel_block)
    tokens = torch.randint(0, 100, (3, 20))
    assert model(tokens).shape == (3, 20, 128)  # padded vocabulary
    # small init: predictions near uniform over the 100 real tokens
    assert model(tokens, tokens).item() == pytest.approx(math.log(100), abs=0.1)


def test_output_is_causal():
    model = _model()
    tokens = torch.randint(0, 100, (1, 16))
    changed = tokens.clone()
    changed[0, 10] = (tokens[0, 10] + 1) % 100
    a, b = model(tokens), model(changed)
    assert torch.equal(a[0, :10], b[0, :10])
    assert not torch.allclose(a[0, 10:], b[0, 10:])


@pytest.mark.parametrize("full_attention_every", [None, 1])
def test_sliding_window_limits_what_a_token_sees(full_attention_every):
    # one layer, window 4: position i sees positions i-3..i only (unless that layer attends fully)
    model = _model(n_layers=1, sliding_window=4, full_attention_every=full_attention_every)
    tokens = torch.randint(0, 100, (1, 16))
    changed = tokens.clone()
    changed[0, 2] = (tokens[0, 2] + 1) % 100
    a, b = model(tokens), model(changed)
    assert not torch.allclose(a[0, 2:6], b[0, 2:6])  # positions 2..5 have position 2 in their window
    if full_attention_every is None:
        assert torch.equal(a[0, 6:], b[0, 6:])
    else:
        assert not torch.allclose(a[0, 6:], b[0, 6:])


def test_padding_never_enters_the_loss_or_sampling():
    model = _model()
    tokens = torch.randint(0, 100, (2, 12))
    loss = model(tokens, tokens)
    with torch.no_grad():
        model.head.proj["logits"].weight[100:] = 10.0  # make padded logits dominate
    assert model(tokens, tokens).item() == pytest.approx(loss.item(), abs=1e-6)
    out = generate(
        model, tokens[:, :4], max_new_tokens=8, temperature=1.0, generator=torch.Generator().manual_seed(0)
    )
    assert out.shape == (2, 12) and int(out.max()) < 100


def test_meta_build_then_init_equals_direct_build():
    direct = _model(seed=3, tie_embeddings=True, bias=True, activation="gelu")
    torch.manual_seed(3)
    with torch.device("meta"):
        lazy = GPT(GPTConfig(**TINY, tie_embeddings=True, bias=True, activation="gelu"))
    lazy.to_empty(device="cpu")
    lazy.init_weights()
    for (name, a), b in zip(direct.state_dict().items(), lazy.state_dict().values()):
        assert torch.equal(a, b), name
    assert torch.equal(direct.rope.cos, lazy.rope.cos)


def test_tied_embeddings_share_one_parameter():
    model = _model(tie_embeddings=True)
    assert model.head.proj["logits"].weight is model.embed.weight
    untied = _model(tie_embeddings=False)
    assert untied.num_parameters() - model.num_parameters() == 128 * 32


def test_grouped_query_attention_shrinks_key_value_projections():
    mha, mqa = _model(), _model(n_kv_heads=1)
    assert mqa.blocks["0"].in_proj["k"].weight.shape == (8, 32)  # one head of 8
    assert mha.num_parameters() - mqa.num_parameters() == 2 * 2 * (32 - 8) * 32
    mqa(torch.randint(0, 100, (1, 8)), torch.randint(0, 100, (1, 8))).backward()


@pytest.mark.parametrize(
    "overrides",
    [
        dict(parallel_block=True),
        dict(parallel_block=False, norm="layernorm", activation="gelu", bias=True, dropout=0.1),
    ],
)
def test_training_reduces_the_loss(overrides):
    _assert_training_reduces_the_loss(_model(**overrides))


def _assert_training_reduces_the_loss(model: GPT) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 100, (4, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(30):
        loss = model(tokens[:, :-1], tokens[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_forced_kernel_backends_agree():
    tokens = torch.randint(0, 100, (2, 16))
    losses = [
        _model(kernels={"attention": b}, sliding_window=5)(tokens, tokens).item() for b in ("sdpa", "torch")
    ]
    assert losses[0] == pytest.approx(losses[1], abs=1e-5)


def test_too_long_sequence_is_rejected():
    with pytest.raises(ValueError, match="longer than max_seq_len=32"):
        _model()(torch.zeros(1, 33, dtype=torch.long))


def test_flops_per_token():
    cfg = GPTConfig(**{**TINY, "n_layers": 1})
    d, f, v = 32, cfg.ffn_dim, 128
    matmuls = 4 * d * d + 3 * d * f + d * v
    assert flops_per_token(cfg, 16) == pytest.approx(6 * matmuls + 12 * d * (16 + 1) / 2)
    windowed = GPTConfig(**{**TINY, "n_layers": 1, "sliding_window": 4})
    assert flops_per_token(windowed, 16) < flops_per_token(cfg, 16)
    # heads wider than d_model / n_heads: q and o are n_heads·head_size wide, and so is the attention
    wide = GPTConfig(**{**TINY, "n_layers": 1, "head_size": 16, "n_kv_heads": 2})
    q, kv = 4 * 16, 2 * 16
    matmuls = d * (q + 2 * kv) + q * d + 3 * d * f + d * v
    assert flops_per_token(wide, 16) == pytest.approx(6 * matmuls + 12 * q * (16 + 1) / 2)
    # a window as long as the sequence costs the same as full attention
    assert flops_per_token(GPTConfig(**{**TINY, "sliding_window": 16}), 16) == flops_per_token(
        GPTConfig(**TINY), 16
    )


@pytest.mark.parametrize("parallel_block", [True, False], ids=["parallel", "sequential"])
def test_options_of_hugging_face_families(parallel_block):
    """qkv_bias, qk_norm, head_size and rope_scaling build, initialise like a meta build, and train in both
    block kinds (their numerics against transformers: tests/core/hf)."""
    options = dict(TINY, parallel_block=parallel_block, qkv_bias=True, qk_norm=True, head_size=16, n_kv_heads=2,
                   rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8))  # fmt: skip
    model = _model(**options)
    params = dict(model.named_parameters())
    biases = sorted(n.split(".")[-2] for n in params if n.endswith("bias") and n.startswith("blocks.0."))
    assert biases == ["k", "q", "v"]  # q, k, v only: not o, not the MLP
    attn = "blocks.0.attn" if parallel_block else "blocks.0.attn.core"
    assert params[f"{attn}.q_norm.weight"].shape == params[f"{attn}.k_norm.weight"].shape == (16,)
    proj = model.blocks["0"].in_proj if parallel_block else model.blocks["0"].attn.in_proj
    assert proj["q"].weight.shape == (4 * 16, 32) and proj["k"].weight.shape == (2 * 16, 32)
    torch.manual_seed(0)
    with torch.device("meta"):
        lazy = GPT(GPTConfig(**options))
    lazy.to_empty(device="cpu")
    lazy.init_weights(model.init_seed)
    for (name, a), b in zip(model.state_dict().items(), lazy.state_dict().values()):
        assert torch.equal(a, b), name
    assert torch.equal(model.rope.cos, lazy.rope.cos)
    _assert_training_reduces_the_loss(model)


def test_rope_scaling_slows_only_the_low_frequencies():
    from megascale.core.kernels import rope_frequencies

    plain = rope_frequencies(16, 500000.0)
    scaled = rope_frequencies(16, 500000.0, GPTConfig(rope_scaling=dict(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=64)).rope_scaling)  # fmt: skip
    wavelength = 2 * math.pi / plain  # 6.3, 32.4, 167, ...: kept below 64/4, slowed 8x above 64/1
    assert torch.equal(scaled[wavelength < 16], plain[wavelength < 16])
    assert torch.allclose(scaled[wavelength > 64], plain[wavelength > 64] / 8)
    between = (wavelength >= 16) & (wavelength <= 64)
    assert between.sum() == 1 and plain[between] / 8 < scaled[between] < plain[between]


def test_greedy_generation_is_deterministic():
    model = _model()
    prompt = torch.randint(0, 100, (1, 5))
    a = generate(model, prompt, max_new_tokens=6, temperature=0)
    b = generate(model, prompt, max_new_tokens=6, temperature=0)
    assert torch.equal(a, b) and torch.equal(a[:, :5], prompt)
