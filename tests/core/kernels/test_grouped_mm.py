"""kernels.grouped_mm: torch._grouped_mm and the reference loop agree, empty groups and no rows included."""

from __future__ import annotations

import pytest
import torch

from megascale.core import kernels
from megascale.core.kernels.grouped_mm import UNALIGNED


def _explicit(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    rows, start = [], 0
    for g, n in enumerate(counts):
        for r in range(start, start + n):
            rows.append(weight[g] @ x[r])  # one row at a time: nothing shared with either backend
        start += n
    return torch.stack(rows) if rows else x.new_zeros(0, weight.shape[1]) + 0 * (x.sum() + weight.sum())


@pytest.mark.parametrize("backend", ["grouped_mm", "torch"])
@pytest.mark.parametrize("counts", [[5, 0, 11, 2], [0, 0, 0, 0], [18, 0, 0, 0]])
def test_each_row_group_is_multiplied_by_its_own_weight(backend: str, counts: list[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), 16, generator=gen, requires_grad=True)
    weight = torch.randn(4, 8, 16, generator=gen, requires_grad=True)
    got = kernels.grouped_mm(x, weight, torch.tensor(counts), backend=backend)
    want = _explicit(x, weight, counts)
    torch.testing.assert_close(got, want)
    cotangent = torch.randn(got.shape, generator=gen)
    gx, gw = torch.autograd.grad(got, (x, weight), cotangent)
    wx, ww = torch.autograd.grad(want, (x, weight), cotangent)
    torch.testing.assert_close(gx, wx)
    torch.testing.assert_close(gw, ww)
    for g, n in enumerate(counts):
        if n == 0:  # an expert that got no tokens: a zero gradient, never garbage
            assert torch.equal(gw[g], torch.zeros_like(gw[g]))


def test_widths_whose_rows_are_not_16_byte_aligned_take_the_reference() -> None:
    x, weight = torch.randn(6, 6), torch.randn(2, 5, 6)  # 24- and 20-byte rows in fp32
    counts = torch.tensor([2, 4])
    assert kernels.grouped_mm.case_of(x, weight, counts) == UNALIGNED
    assert kernels.grouped_mm.select(torch.device("cpu"), None, UNALIGNED).name == "torch"
    torch.testing.assert_close(kernels.grouped_mm(x, weight, counts), _explicit(x, weight, [2, 4]))


def test_the_reference_refuses_counts_that_do_not_add_up() -> None:
    with pytest.raises(ValueError, match="add up to 5 rows, x has 6"):
        kernels.grouped_mm(torch.randn(6, 16), torch.randn(2, 8, 16), torch.tensor([2, 3]), backend="torch")


@pytest.mark.parametrize("counts", [[3, 0, 2, 0], [0, 0, 0, 0]])
def test_under_autocast_no_rows_come_out_in_the_dtype_rows_would(counts: list[int]) -> None:
    """Expert-parallel peers exchange these outputs: a rank that received no rows must send what its peer
    expects to receive (bf16 under autocast), or the all-to-all aborts on a size mismatch."""
    x = torch.randn(sum(counts), 16, requires_grad=True)
    weight = torch.randn(4, 8, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = kernels.grouped_mm(x, weight, torch.tensor(counts), backend="torch")
    assert got.dtype == torch.bfloat16 and got.shape == (sum(counts), 8)
    gx, gw = torch.autograd.grad(got.float().sum(), (x, weight))
    assert gx.shape == x.shape and gw.shape == weight.shape
