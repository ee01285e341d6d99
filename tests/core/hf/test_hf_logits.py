"""megascale's GPT built from a Hugging Face checkpoint computes what transformers computes.

For each family (Llama 3 with llama3 rope scaling, Qwen2 with q/k/v biases, Qwen3 with q/k norms and
head_dim != hidden/heads, Mistral with a sliding window shorter than the sequence), tied and untied: logits
of the same tokens, the next-token loss, and 20 greedy tokens (transformers' ``generate(do_sample=False)``
with its KV cache; megascale recomputes the context) agree. Tolerance 1e-5 in fp32; observed: bitwise equal
(both run the same fp32 operations: rotary tables computed as transformers does, RMSNorm statistics in fp32,
torch's scaled_dot_product_attention).
"""

from __future__ import annotations

import pytest
import torch

from megascale.core import generate
from megascale.core.hf import gpt_from_hf
from tests.core.hf._tiny_hf import FAMILIES, VOCAB, save_tiny, tokens

ATOL = 1e-5


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_loss_and_greedy_tokens_match_transformers(family, tie, tmp_path):
    hf = save_tiny(family, tie, tmp_path)
    model = gpt_from_hf(tmp_path).eval()
    assert model.config.tie_embeddings is tie
    x = tokens()
    with torch.no_grad():
        expected = hf(x).logits
        logits = model(x)
        hf_loss = hf(x, labels=x).loss  # transformers shifts the labels itself
        loss = model(x[:, :-1], x[:, 1:])
    assert logits.shape[-1] == model.config.padded_vocab_size > VOCAB
    assert (logits[..., :VOCAB] - expected).abs().max().item() <= ATOL
    assert loss.item() == pytest.approx(hf_loss.item(), abs=ATOL)

    prompt = x[:1, :6]
    want = hf.generate(prompt, max_new_tokens=20, do_sample=False)
    got = generate(model, prompt, 20, temperature=0.0)
    assert want.shape == (1, 26)
    assert got.tolist() == want.tolist()


def test_the_options_the_families_need_are_set(tmp_path):
    configs = {}
    for family in FAMILIES:
        save_tiny(family, False, tmp_path / family)
        configs[family] = gpt_from_hf(tmp_path / family).config
    assert configs["llama"].rope_scaling is not None and configs["llama"].rope_scaling.factor == 8.0
    assert configs["qwen2"].qkv_bias and not configs["qwen2"].bias
    assert configs["qwen3"].qk_norm and configs["qwen3"].head_dim == 32 and configs["qwen3"].head_size == 32
    assert configs["mistral"].sliding_window == 8
    assert all(not c.parallel_block for c in configs.values())


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_rotary_frequencies_are_transformers_own_bit_for_bit(family, tmp_path):
    from megascale.core.kernels import rope_frequencies

    hf = save_tiny(family, False, tmp_path)
    config = gpt_from_hf(tmp_path).config
    ours = rope_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    assert torch.equal(ours, hf.model.rotary_emb.inv_freq)
