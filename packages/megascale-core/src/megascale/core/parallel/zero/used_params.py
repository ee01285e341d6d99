"""ZeRO-2/3: the same reduce-scatters on every rank, whichever parameters its data used, and ``p.grad`` None
where no rank used one (as on one process).

FSDP2 reduce-scatters, per unit, the parameters that got a gradient on this rank. A layer that one rank's
data reaches and another's does not in a step (``if sel.any(): loss += extra(h[sel])``) then makes the ranks
issue reduce-scatters of different sizes: gloo fails ("Received data size doesn't match"), NCCL hangs or
mixes buffers. ``set_reduce_scatter_unused_params(True)`` makes every rank include a zero gradient for such a
parameter — the right contribution where another rank used it. Where no rank used it, one process leaves
``p.grad`` None (the optimizer skips it: no momentum, no weight decay), so after the reduction the ranks agree,
by one small all-reduce of flags (DDP's locally-used map, which ZeRO-0/1 here also keep), on which parameters
some rank used, and give the others back the gradient they had before that backward (None, or what an earlier
backward of a manual accumulation left, to which FSDP added zeros).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["UsedParams"]


class UsedParams:
    """Which of some FSDP2 parameters got a gradient on any rank in the backward passes of one reduction.

    ``fsdp_params``: FSDP2's per-parameter records (``FSDPParam``) of every unit; ``group``: the ranks that
    shard them. Call ``watch_gathered`` when gathered copies may have appeared (every root forward) and
    ``after_reduction`` after each backward that reduced gradients."""

    def __init__(self, fsdp_params: list[Any], group: dist.ProcessGroup) -> None:
        self.fsdp_params, self.group = fsdp_params, group
        self._watched: set[int] = set()
        self._used: set[int] = set()
        self._had_grad: list[bool] | None = None  # before the first reduction of this step's backward

    def watch_gathered(self) -> None:
        """A hook on each gathered copy that exists (FSDP2 creates it at the first gather and keeps it), frozen
        ones too: they may be unfrozen later, and their copy follows only at its next gather."""
        if len(self._watched) == len(self.fsdp_params):
            return
        for index, fsdp_param in enumerate(self.fsdp_params):
            gathered = getattr(fsdp_param, "_unsharded_param", None)
            if index in self._watched or gathered is None:
                continue
            frozen = not gathered.requires_grad
            if frozen:  # torch hooks only a tensor that requires grad; the hook stays when it is frozen again
                gathered.requires_grad_(True)
            gathered.register_post_accumulate_grad_hook(self._mark(index))
            if frozen:
                gathered.requires_grad_(False)
            self._watched.add(index)

    def _mark(self, index: int) -> Callable[[Tensor], None]:
        def hook(_: Tensor) -> None:
            self.before_reductions()  # a backward's first gradient comes before its units' reduce-scatters
            self._used.add(index)

        return hook

    def before_reductions(self) -> None:
        """What each gradient is before a backward's first reduce-scatter (call where that may come before any
        gradient: units passed over on the loss, ``skipped_units.py``)."""
        if self._had_grad is None:
            self._had_grad = [fp.sharded_param.grad is not None for fp in self.fsdp_params]

    def after_reduction(self) -> None:
        """Every rank, after a backward that reduce-scattered: the gradients of parameters no rank used are
        what they were before it."""
        if not self.fsdp_params:
            return
        device = self.fsdp_params[0].sharded_param.device
        flags = torch.zeros(len(self.fsdp_params), dtype=torch.int32, device=device)
        if self._used:
            flags[sorted(self._used)] = 1
        dist.all_reduce(flags, group=self.group)
        # a rank whose data used nothing has no snapshot: its gradients were None (else zero_grad was skipped)
        had_grad = self._had_grad or [False] * len(self.fsdp_params)
        for index in (flags == 0).nonzero().flatten().tolist():
            if not had_grad[index]:
                self.fsdp_params[index].sharded_param.grad = None
        self._used, self._had_grad = set(), None
