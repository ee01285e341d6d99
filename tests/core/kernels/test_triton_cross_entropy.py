"""The Triton cross-entropy backend against the torch reference: padded vocabulary, ignored targets, all three
reductions, forward and the gradient of the logits."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megascale.core.kernels import cross_entropy
from tests.core.kernels._compare import compare_with_reference

IGNORE = -100


def _problem(
    shape: tuple[int, ...], vocab_size: int | None, dtype: torch.dtype, seed: int, ignore_index: int = IGNORE
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(shape, generator=g) * 3).to(dtype)
    targets = torch.randint(0, vocab_size or shape[-1], shape[:-1], generator=g)
    flat = targets.view(-1)
    flat[::3] = ignore_index  # every third target is ignored (row 0 too, so rows=1 ignores everything)
    return logits, targets


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("shape", "vocab_size"),
    [((2, 100), None), ((7, 1000), 990), ((3, 11, 257), 250)],
    ids=["rows2-V100", "rows7-V1000-pad10", "rows33-V257-pad7"],
)
def test_cross_entropy(
    shape: tuple[int, ...], vocab_size: int | None, dtype: torch.dtype, reduction: str
) -> None:
    logits, targets = _problem(shape, vocab_size, dtype, seed=shape[-1])
    compare_with_reference(
        cross_entropy, (logits, targets), vocab_size=vocab_size, ignore_index=IGNORE, reduction=reduction
    )


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_many_vocab_blocks(reduction: str) -> None:
    """A small vocabulary block forces the online log-sum-exp over 16 blocks, the last one partly padding."""
    from megascale.core.kernels.triton.cross_entropy import cross_entropy as fused

    options = {"vocab_size": 1000 - 37, "ignore_index": 3, "reduction": reduction}
    logits, targets = _problem((9, 1000), 1000 - 37, torch.bfloat16, seed=5, ignore_index=3)
    x = logits.clone().requires_grad_(True)
    out = fused(x, targets, block_v=64, **options)
    xr = logits.float().requires_grad_(True)
    ref = cross_entropy(xr, targets, backend="torch", **options)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out.sum().backward()  # for "none": an expanded (stride 0) incoming gradient
    ref.sum().backward()
    torch.testing.assert_close(x.grad.float(), xr.grad, rtol=2**-7, atol=1e-4)


def test_padding_and_ignored_rows_get_zero_gradient_and_logits_are_untouched() -> None:
    logits, targets = _problem((6, 40), 33, torch.float32, seed=6)
    logits[:, 33:] = 1e4  # padding columns would dominate the softmax if they took part
    before = logits.clone()
    x = logits.clone().requires_grad_(True)
    loss = cross_entropy(x, targets, vocab_size=33, backend="triton")
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.equal(x.detach(), before)
    assert torch.all(x.grad[:, 33:] == 0)
    assert torch.all(x.grad[targets == IGNORE] == 0)
    ref = cross_entropy(before, targets, vocab_size=33, backend="torch")
    torch.testing.assert_close(loss, ref)


def test_all_targets_ignored_matches_torch() -> None:
    """Mean over zero counted targets is nan in torch; the fused loss agrees and the gradient stays 0."""
    logits = torch.randn(4, 30, requires_grad=True)
    targets = torch.full((4,), IGNORE)
    loss = cross_entropy(logits, targets, backend="triton")
    assert torch.isnan(loss)
    assert torch.isnan(cross_entropy(logits, targets, backend="torch"))
    loss.backward()
    assert torch.all(logits.grad == 0)
    total = cross_entropy(logits, targets, reduction="sum", backend="triton")
    assert total.item() == 0.0
