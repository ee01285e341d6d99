"""The Triton bias-GeLU, SwiGLU and RoPE backends against their torch references, forward and backward."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megascale.core.kernels import apply_rope, bias_gelu, rope_tables, swiglu
from tests.core.kernels._compare import compare_with_reference

SHAPES = [(1, 48), (7, 100), (3, 11, 257)]
DTYPES = [torch.float32, torch.bfloat16]


def _randn(shape: tuple[int, ...], dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bias_gelu(shape: tuple[int, ...], dtype: torch.dtype, with_bias: bool) -> None:
    # scale 3 reaches both tails of GeLU, where tanh saturates
    x = _randn(shape, dtype, seed=sum(shape), scale=3.0)
    bias = _randn((shape[-1],), dtype, seed=7) if with_bias else None
    compare_with_reference(bias_gelu, (x, bias))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_swiglu(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    gate = _randn(shape, dtype, seed=sum(shape), scale=3.0)
    up = _randn(shape, dtype, seed=sum(shape) + 1)
    compare_with_reference(swiglu, (gate, up))


def test_pointwise_fp16() -> None:
    x = _randn((6, 70), torch.float16, seed=1, scale=3.0)
    compare_with_reference(bias_gelu, (x, _randn((70,), torch.float16, seed=2)))
    compare_with_reference(swiglu, (x, _randn((6, 70), torch.float16, seed=3)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("B", "T", "H", "hd"), [(1, 1, 1, 8), (2, 7, 3, 48), (1, 9, 5, 100)])
def test_rope(B: int, T: int, H: int, hd: int, dtype: torch.dtype) -> None:
    cos, sin = rope_tables(T + 5, hd, theta=10000.0)  # tables longer than the sequence, as in the model
    x = _randn((B, T, H, hd), dtype, seed=B * T * H + hd)
    compare_with_reference(apply_rope, (x, cos, sin), differentiable=[0])


def test_rope_on_a_strided_view() -> None:
    """q taken from a fused (B, T, 3, H, hd) projection is a non-contiguous view: rotated without a copy."""
    qkv = _randn((2, 5, 3, 4, 16), torch.float32, seed=4)
    cos, sin = rope_tables(5, 16, theta=500.0)
    q = qkv[:, :, 0]
    assert not q.is_contiguous()
    compare_with_reference(apply_rope, (q, cos, sin), differentiable=[0])


def test_rope_backward_is_the_inverse_rotation() -> None:
    """For a rotation R, the gradient of <R x, g> w.r.t. x is R^T g = rotation of g by the opposite angle."""
    cos, sin = rope_tables(6, 32, theta=100.0)
    x = torch.randn(1, 6, 2, 32, requires_grad=True)
    g = torch.randn(1, 6, 2, 32)
    (apply_rope(x, cos, sin, backend="triton") * g).sum().backward()
    torch.testing.assert_close(x.grad, apply_rope(g, cos, -sin, backend="torch"))
