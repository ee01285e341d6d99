"""Shared check for the fused-backend tests: run a kernel's backend and its torch reference, compare outputs
and the gradients of every differentiable input.

The reference runs in fp32 on the fp32 upcast of the very same inputs (exact: bf16/fp16 values are fp32
values), so it is the true answer for those inputs. The fused kernels compute in fp32 and round once to the
output dtype, so they must land within half a unit in the last place of that dtype, plus fp32 noise:
- fp32: rtol 1e-5 (a few fp32 ulps of summation-order noise over rows of up to 257 elements);
- bf16: rtol 2**-7, twice the worst half-ulp rounding error (bf16 keeps 8 significant bits);
- fp16: rtol 2**-10, likewise for fp16's 11 significant bits.
atol covers values that are zero up to fp32 cancellation noise (e.g. LayerNorm's dx, a difference of O(1)
terms). The bf16 torch reference itself rounds intermediates (silu(gate) before * up, x + bias before
GeLU), so comparing against it would need a looser, less meaningful tolerance.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

TOLERANCES = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.bfloat16: {"rtol": 2**-7, "atol": 1e-4},
    torch.float16: {"rtol": 2**-10, "atol": 1e-4},
}


def compare_with_reference(
    kernel: Callable[..., torch.Tensor],
    args: Sequence[object],
    *,
    backend: str = "triton",
    differentiable: Sequence[int] | None = None,
    **kwargs: object,
) -> None:
    """Forward and backward of ``kernel(*args, backend=backend)`` against ``backend="torch"`` in fp32.

    ``differentiable`` lists the positions of the inputs whose gradients are compared (default: every
    floating-point tensor)."""
    if differentiable is None:
        differentiable = [
            i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()
        ]

    def prepare(upcast: bool) -> list[object]:
        out: list[object] = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                a = a.detach().clone()
                if upcast and a.is_floating_point():
                    a = a.float()
                if i in differentiable:
                    a.requires_grad_(True)
            out.append(a)
        return out

    fused_args, ref_args = prepare(upcast=False), prepare(upcast=True)
    out = kernel(*fused_args, backend=backend, **kwargs)
    ref = kernel(*ref_args, backend="torch", **kwargs)
    assert out.shape == ref.shape
    tol = TOLERANCES[out.dtype]
    torch.testing.assert_close(out.float(), ref.float(), **tol, msg=lambda m: f"forward: {m}")

    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(grad_out)
    ref.backward(grad_out.float())
    for i in differentiable:
        got, want = fused_args[i].grad, ref_args[i].grad  # type: ignore[union-attr]
        assert got is not None, f"no gradient for input {i}"
        assert got.dtype == args[i].dtype, f"gradient of input {i} is {got.dtype}, input is {args[i].dtype}"
        tol = TOLERANCES[got.dtype]
        torch.testing.assert_close(
            got.float(), want.float(), **tol, msg=lambda m, i=i: f"grad of input {i}: {m}"
        )
