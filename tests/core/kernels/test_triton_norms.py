"""The Triton RMSNorm and LayerNorm backends against their torch references, forward and backward."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megascale.core.kernels import layer_norm, rms_norm
from tests.core.kernels._compare import compare_with_reference

# Leading shapes flatten to 1, 7 and 33 rows; hidden sizes are not powers of two.
SHAPES = [(1, 48), (7, 100), (3, 11, 257)]
DTYPES = [torch.float32, torch.bfloat16]


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(dtype)
    weight = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(dtype)
    return x, weight


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rms_norm(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x, weight = _inputs(shape, dtype, seed=sum(shape))
    compare_with_reference(rms_norm, (x, weight, 1e-6))


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_layer_norm(shape: tuple[int, ...], dtype: torch.dtype, with_bias: bool) -> None:
    x, weight = _inputs(shape, dtype, seed=sum(shape) + 1)
    bias = torch.randn(shape[-1], generator=torch.Generator().manual_seed(2)).to(dtype) if with_bias else None
    compare_with_reference(layer_norm, (x, weight, bias, 1e-5))


def test_norms_fp16() -> None:
    x, weight = _inputs((5, 96), torch.float16, seed=3)
    compare_with_reference(rms_norm, (x, weight, 1e-6))
    compare_with_reference(layer_norm, (x, weight, weight.flip(0), 1e-5))


def test_rms_norm_strided_rows() -> None:
    """A view with a row stride wider than the row (a slice of a fused projection) needs no copy."""
    wide = torch.randn(9, 160)
    x = wide[:, :100]
    compare_with_reference(rms_norm, (x, torch.rand(100) + 0.5, 1e-6))
