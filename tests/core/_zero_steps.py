"""What the ZeRO-1 tests (test_zero.py: whole parameters by owner; test_zero_elements.py: pieces) share: the
per-rank batches and their union for the one-process reference, the optimizers compared, and gathering a
parameter whole. Both step the tiny GQA GPT STEPS times at LR, clipping every step (MAX_NORM is below its
gradient norm, ~3), with 4 KiB buckets (many buckets for the tiny GPT)."""

from __future__ import annotations

from typing import Any

import torch

from megascale.core.optim import LAMB
from tests.core._tiny import TINY_GQA_GPT

STEPS = 4
LR = 1e-2
MAX_NORM = 1.0
BUCKET_MB = 4096 / 2**20
CONFIG = dict(TINY_GQA_GPT)


def batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This dp rank's batch of ``step``."""
    gen = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randint(0, 60, (2, 8), generator=gen), torch.randint(0, 60, (2, 8), generator=gen)


def union(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every dp rank's batch of ``step`` together: what the one-process reference trains on."""
    parts = [batch(step, r) for r in range(dp)]
    return torch.cat([t for t, _ in parts]), torch.cat([y for _, y in parts])


def optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    """ "adamw-foreach", "adamw-loop" or "lamb"."""
    if kind == "adamw-foreach":
        return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, foreach=True)
    if kind == "adamw-loop":
        return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, foreach=False)
    assert kind == "lamb"
    return LAMB(params, lr=LR, weight_decay=0.01)


def full(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole (a DTensor gathered), detached."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
