"""Triton backends of the kernels, and the checks that say where they may run.

Each module here (rms_norm, layer_norm, bias_gelu, swiglu, rope, cross_entropy) holds the Triton kernels of
one operation and a ``torch.autograd.Function`` whose forward and backward launch them; every module imports
triton at its top, so the kernel files import them only inside their ``triton`` backend function and
``import megascale.core`` never imports triton. This package file must stay free of triton imports: the
registry evaluates the checks below on machines without it.

Where they run: on CUDA when triton imports. On the CPU Triton runs only through its interpreter
(``TRITON_INTERPRET=1``, set before the first kernel module is imported): correct but slow, for tests. So
automatic selection never picks them on the CPU, while ``backend="triton"`` may, when the interpreter is on.
"""

from __future__ import annotations

import torch

from megascale.core import _optional

__all__ = ["unavailable", "unavailable_if_forced"]

_CPU_REASON = (
    "Triton on CPU runs only in the interpreter (TRITON_INTERPRET=1), for tests; "
    "force it with backend='triton'"
)


def unavailable_if_forced(device: torch.device) -> str | None:
    """Why a Triton backend cannot run on ``device`` at all (None when it can)."""
    if _optional.triton() is None:
        return _optional.missing_reason("triton")
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        if _optional.triton_interpreted():
            return None
        # triton.jit picks the interpreter when a kernel module is imported, i.e. at the first Triton call.
        return "Triton on CPU needs its interpreter: set TRITON_INTERPRET=1 before the first Triton call"
    return f"the Triton backends run on CUDA (or on the CPU through the interpreter), not on {device.type}"


def unavailable(device: torch.device) -> str | None:
    """Why automatic selection skips a Triton backend on ``device`` (None when it may pick it)."""
    reason = unavailable_if_forced(device)
    if reason is None and device.type != "cuda":
        return _CPU_REASON
    return reason
