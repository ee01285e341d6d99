"""The Triton backends are drop-in for the model: a tiny GPT with every fusable kernel forced to Triton gives
the loss and parameter gradients of the same GPT on the torch references (fp32, interpreter)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megascale.core import GPT, GPTConfig

FUSED = ["rms_norm", "layer_norm", "bias_gelu", "swiglu", "rope", "cross_entropy"]
TINY = dict(
    vocab_size=100,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    max_seq_len=32,
    pad_vocab_to_multiple_of=64,
)


@pytest.mark.parametrize(
    "variant",
    [
        {"norm": "rmsnorm", "activation": "swiglu"},
        {"norm": "layernorm", "activation": "gelu", "bias": True, "parallel_block": False},
    ],
    ids=["rmsnorm-swiglu", "layernorm-gelu"],
)
def test_gpt_on_triton_kernels_matches_torch(variant: dict) -> None:
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    targets = tokens.roll(-1, dims=1)
    targets[0, :3] = -100
    results = {}
    for backend in ("torch", "triton"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**TINY, **variant, kernels=dict.fromkeys(FUSED, backend)))
        loss = model(tokens, targets)
        loss.backward()
        results[backend] = (loss.detach(), [p.grad for p in model.parameters()])
    torch.testing.assert_close(results["triton"][0], results["torch"][0], rtol=1e-6, atol=1e-6)
    for got, want in zip(results["triton"][1], results["torch"][1]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
