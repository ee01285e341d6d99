"""Attention backends that run on the CPU (sdpa and the torch reference) against each other and against
masks written out here, independently of attention.attention_mask: sliding window, GQA, window >= T."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from megascale.core.kernels import attention, registry


def _qkv(B: int, T: int, H: int, KV: int, hd: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, T, h, hd, generator=g) for h in (H, KV, KV))


def _explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    """Softmax attention with the mask spelled out: query i sees keys j with i - window < j <= i."""
    B, T, H, hd = q.shape
    rep = H // k.shape[2]
    out = torch.zeros(B, T, H, hd, dtype=torch.float64)
    for h in range(H):
        kh, vh = k[:, :, h // rep].double(), v[:, :, h // rep].double()  # query head h uses kv head h // rep
        for i in range(T):
            lo = 0 if window is None else max(0, i - window + 1)
            scores = torch.einsum("bd,bsd->bs", q[:, i, h].double(), kh[:, lo : i + 1]) / math.sqrt(hd)
            out[:, i, h] = torch.einsum("bs,bsd->bd", scores.softmax(-1), vh[:, lo : i + 1])
    return out.float()


@pytest.mark.parametrize("window", [None, 1, 3, 6])
@pytest.mark.parametrize("backend", ["sdpa", "torch"])
def test_matches_explicit_mask(backend: str, window: int | None) -> None:
    q, k, v = _qkv(2, 9, 4, 4, 8, seed=window or 0)
    out = attention(q, k, v, window=window, backend=backend)
    torch.testing.assert_close(out, _explicit(q, k, v, window), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("backend", ["sdpa", "torch"])
def test_gqa_equals_repeated_kv_heads(backend: str, window: int | None) -> None:
    q, k, v = _qkv(2, 7, 6, 2, 16, seed=3)
    out = attention(q, k, v, window=window, backend=backend)
    k_rep, v_rep = k.repeat_interleave(3, dim=2), v.repeat_interleave(3, dim=2)
    torch.testing.assert_close(out, attention(q, k_rep, v_rep, window=window, backend="torch"))
    torch.testing.assert_close(out, _explicit(q, k, v, window), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "torch"])
def test_window_at_least_sequence_equals_full_causal(backend: str) -> None:
    q, k, v = _qkv(1, 8, 2, 1, 8, seed=4)
    full = attention(q, k, v, window=None, backend=backend)
    for window in (8, 9, 100):
        torch.testing.assert_close(attention(q, k, v, window=window, backend=backend), full)


@pytest.mark.parametrize("window", [None, 3])
def test_sdpa_and_torch_agree_forward_and_backward(window: int | None) -> None:
    inputs = _qkv(2, 10, 4, 2, 8, seed=5)
    grads = {}
    outs = {}
    for backend in ("sdpa", "torch"):
        q, k, v = (t.clone().requires_grad_(True) for t in inputs)
        out = attention(q, k, v, window=window, scale=0.3, backend=backend)
        out.backward(torch.ones_like(out).cumsum(1))
        outs[backend], grads[backend] = out, (q.grad, k.grad, v.grad)
    torch.testing.assert_close(outs["sdpa"], outs["torch"], rtol=1e-5, atol=1e-5)
    for got, want in zip(grads["sdpa"], grads["torch"]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_bf16_sdpa_matches_reference() -> None:
    q, k, v = (t.bfloat16() for t in _qkv(1, 12, 4, 2, 16, seed=6))
    out = attention(q, k, v, window=5, backend="sdpa")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _explicit(q, k, v, 5), rtol=2**-7, atol=2**-7)


def test_rejects_a_window_below_one() -> None:
    q, k, v = _qkv(1, 4, 2, 2, 8, seed=7)
    with pytest.raises(ValueError, match="sliding window must be >= 1"):
        attention(q, k, v, window=0, backend="torch")


def test_flex_matches_the_reference_forward_and_backward_at_the_sequence_edges() -> None:
    """FlexAttention (eager on the CPU) with its cached block mask, grouped-query heads and a scale: windows of
    1 (itself only), 7 (dividing neither T nor FlexAttention's 128-token blocks), T and none (full causal), against the written-out mask forward and the torch reference backward."""
    inputs = _qkv(2, 10, 4, 2, 8, seed=8)
    cotangent = torch.randn(2, 10, 4, 8, generator=torch.Generator().manual_seed(9))
    for window in (1, 7, 10, None):
        grads = {}
        for backend in ("flex", "torch"):
            q, k, v = (t.clone().requires_grad_(True) for t in inputs)
            out = attention(q, k, v, window=window, scale=0.3, backend=backend)
            grads[backend] = torch.autograd.grad(out, (q, k, v), cotangent)
            if backend == "flex":
                want = _explicit(*(t * s for t, s in zip(inputs, (0.3 * math.sqrt(8), 1, 1))), window)
                torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5, msg=f"window {window}")
        for got, want in zip(grads["flex"], grads["torch"]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"window {window}")


def test_windowed_calls_are_chosen_apart_and_sdpa_says_which_kernel_ran(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    registry.reset()
    caplog.set_level(logging.INFO, logger="megascale.core.kernels")
    q, k, v = _qkv(1, 8, 2, 1, 8, seed=10)
    for _ in range(2):
        attention(q, k, v, window=3)
        attention(q, k, v, window=8)  # a window as long as the sequence is full causal attention
    window_choice = attention.explain("cpu", case="window")
    assert window_choice.startswith("sdpa (") and "SDPA ran its " in window_choice, window_choice
    choices = [m for m in caplog.messages if m.startswith("megascale kernel attention on cpu")]
    assert any(m.startswith("megascale kernel attention on cpu (window): sdpa (skipped ") for m in choices)
    assert any("flex: FlexAttention is compiled on CUDA only" in m for m in choices), choices
    ran = [m for m in choices if "SDPA ran its " in m]
    assert len(ran) == 2, ran  # once per case (causal, window), not per call
    registry.reset()
