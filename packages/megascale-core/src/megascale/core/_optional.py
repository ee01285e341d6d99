"""The one place megascale-core probes optional packages: flash-attn, NVIDIA apex, Triton (accelerators) and
safetensors (Hugging Face checkpoints, ``megascale.core.hf``).

Probes are lazy (nothing is imported until a kernel asks) and cached. Each returns the module, or None and a
reason a user can act on, so the kernel registry can say which backend runs and why. No warnings at import.
"""

from __future__ import annotations

import importlib
import os
from functools import cache
from types import ModuleType

import torch

__all__ = [
    "apex_norms",
    "apex_norms_unavailable",
    "apex_optimizers",
    "flash_attn",
    "flash_attn_cute",
    "missing_reason",
    "safetensors",
    "triton",
    "triton_interpreted",
]

_INSTALL_HINTS = {
    "flash_attn": "pip install 'megascale-core[flash]' for flash-attn 2 (needs a CUDA build of torch), or "
    "pip install flash-attn-4 for flash_attn.cute (Hopper/Blackwell, prebuilt wheels)",
    "apex": "NVIDIA apex is not on PyPI (the PyPI 'apex' is another project): build it from "
    "https://github.com/NVIDIA/apex with --cpp_ext --cuda_ext",
    "triton": "pip install 'megascale-core[triton]' (CUDA builds of torch ship it)",
    "safetensors": "pip install 'megascale-core[hf]'",
}

_reasons: dict[str, str] = {}


@cache
def _probe(module: str, attribute_check: str | None = None) -> ModuleType | None:
    try:
        mod = importlib.import_module(module)
        if attribute_check is not None:
            importlib.import_module(attribute_check)
    except Exception as exc:  # ImportError, or a broken CUDA extension raising OSError/RuntimeError
        top = module.split(".")[0]
        _reasons[module] = f"{module} is not importable ({type(exc).__name__}: {exc}); {_INSTALL_HINTS[top]}"
        return None
    return mod


def missing_reason(module: str) -> str:
    """Why the last probe of ``module`` found nothing (empty if it was found)."""
    return _reasons.get(module, "")


def flash_attn() -> ModuleType | None:
    """The flash_attn package (>= 2.6 for sliding windows), or None."""
    mod = _probe("flash_attn")
    if mod is not None and not hasattr(mod, "flash_attn_func"):
        # flash-attn-4 alone installs flash_attn/cute without flash_attn/__init__.py: a namespace package.
        _reasons["flash_attn"] = (
            "flash_attn has no flash_attn_func (flash-attn-4 alone installs only flash_attn.cute, which the "
            f"flash4 backend uses); {_INSTALL_HINTS['flash_attn']}"
        )
        return None
    return mod


def flash_attn_cute() -> ModuleType | None:
    """flash-attn 4's CuTe-DSL kernels (``flash_attn.cute``: Hopper and Blackwell), or None."""
    return _probe("flash_attn.cute")


def apex_norms() -> ModuleType | None:
    """apex.normalization.fused_layer_norm with its compiled CUDA extension, or None."""
    return _probe("apex.normalization.fused_layer_norm", "fused_layer_norm_cuda")


def apex_optimizers() -> ModuleType | None:
    """apex.optimizers (FusedLAMB) with amp_C, the compiled multi-tensor extension it needs, or None."""
    return _probe("apex.optimizers", "amp_C")


def apex_norms_unavailable(device: torch.device) -> str | None:
    """Why apex's fused norms cannot run on ``device`` (None when they can): the kernel registry's check."""
    if device.type != "cuda":
        return "apex fused norms run on CUDA only"
    if apex_norms() is None:
        return missing_reason("apex.normalization.fused_layer_norm")
    return None


def safetensors() -> ModuleType | None:
    """safetensors with its torch bindings (``safetensors.torch``), or None."""
    return _probe("safetensors", "safetensors.torch")


def triton() -> ModuleType | None:
    """The triton package, or None."""
    return _probe("triton")


def triton_interpreted() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (TRITON_INTERPRET=1): slow, for tests."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
