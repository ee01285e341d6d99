"""Next-token cross-entropy over a (possibly padded) vocabulary.

logits (..., V) and integer targets (...). Columns at or beyond ``vocab_size`` are padding (the model pads its
vocabulary so tensor parallelism can shard it) and take no part in the softmax, so padding never changes the
loss. Targets equal to ``ignore_index`` are skipped; ``reduction="mean"`` averages over the others.

Backends, fastest first: ``triton`` (kernels/triton/cross_entropy.py: online log-sum-exp over vocabulary
blocks, no fp32 copy of the logits, gradient written in the logits' dtype), ``torch`` (the reference, which
materialises the logits in fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megascale.core.kernels import triton as _triton
from megascale.core.kernels.registry import Probe, ProbeInputs, get_kernel

__all__ = ["cross_entropy"]

cross_entropy = get_kernel("cross_entropy")


@cross_entropy.register("triton", _triton.unavailable, unavailable_if_forced=_triton.unavailable_if_forced)
def _triton_backend(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    from megascale.core.kernels.triton.cross_entropy import cross_entropy as fused

    return fused(logits, targets, vocab_size=vocab_size, ignore_index=ignore_index, reduction=reduction)


@cross_entropy.register("torch")
def _reference(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    logits = logits.reshape(-1, logits.shape[-1])
    if vocab_size is not None and vocab_size < logits.shape[-1]:
        logits = logits[:, :vocab_size]
    return F.cross_entropy(
        logits.float(), targets.reshape(-1), ignore_index=ignore_index, reduction=reduction
    )


def probe_sizes(device_type: str) -> tuple[int, int, int]:
    """(rows, logits width, valid vocabulary) of the probe. On a GPU the vocabulary spans three of the Triton
    kernel's 8192-column blocks, the last one partial and past the valid columns: the block loop every
    32k-128k vocabulary runs, in the block size it runs with (about 0.5 MB of logits). The CPU (tests, Triton's
    interpreter) keeps a small one."""
    return (8, 16_448, 16_400) if device_type == "cuda" else (8, 96, 90)


def _probe(device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> ProbeInputs:
    rows, width, vocab = probe_sizes(device.type)
    logits = 2 * torch.randn(rows, width, generator=gen)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[3] = -100  # an ignored position
    return (logits.to(device, dtype), targets.to(device)), {"vocab_size": vocab}, (0,)


cross_entropy.probe = Probe(_probe)
