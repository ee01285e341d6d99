"""Kernels with interchangeable backends; the ``torch`` backend of each is the reference.

Every kernel is called like a function; ``backend=`` forces one implementation. See ``registry`` for how the
choice is made and logged, and ``python -m megascale.core.kernels`` for what runs on this machine.
"""

from megascale.core.kernels.attention import attention, document_ids
from megascale.core.kernels.bias_gelu import bias_gelu
from megascale.core.kernels.cross_entropy import cross_entropy
from megascale.core.kernels.grouped_mm import grouped_mm
from megascale.core.kernels.layer_norm import layer_norm
from megascale.core.kernels.registry import (
    Kernel,
    KernelUnavailableError,
    describe,
    get_kernel,
    kernels,
    reset,
)
from megascale.core.kernels.rms_norm import rms_norm
from megascale.core.kernels.rope import apply_rope, rope_frequencies, rope_tables
from megascale.core.kernels.swiglu import swiglu

__all__ = [
    "Kernel",
    "KernelUnavailableError",
    "apply_rope",
    "attention",
    "bias_gelu",
    "cross_entropy",
    "describe",
    "document_ids",
    "get_kernel",
    "grouped_mm",
    "kernels",
    "layer_norm",
    "reset",
    "rms_norm",
    "rope_frequencies",
    "rope_tables",
    "swiglu",
]
