"""Stages the loss did not reach: their parameters get no gradient (None), as on one process.

A stage whose inputs the loss does not reach (a later stage detached them, in every microbatch) has no input
gradients to send; torch's pipelining sends zeros instead, so the stages before it run a backward of zeros
and their parameters get zero gradients where one process leaves them None, and AdamW, momentum or weight
decay step them anyway. After each training step the ranks agree (one small all-reduce over the world, since
data-parallel replicas reduce these gradients together) which stages sent no gradient in any microbatch on
any replica; the parameters of every stage before such a stage that had no gradient when the step began get
none again. (A gradient accumulated by earlier steps had zeros added: it is left as it is.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["UnreachedStages"]


class UnreachedStages:
    """Per training step: ``begin()``, ``sent(stage_id, grads)`` for each backward's input gradients (every
    stage but the first), then ``end()``, on every rank."""

    def __init__(self, stage_modules: Sequence[nn.Module], stage_ids: Sequence[int], num_stages: int,
                 device: torch.device) -> None:  # fmt: skip
        self.stage_modules, self.stage_ids, self.num_stages = list(stage_modules), list(stage_ids), num_stages
        self.device = device
        self._gradless: list[list[nn.Parameter]] = []
        self._sent: set[int] = set()

    def begin(self) -> None:
        self._gradless = [[p for p in m.parameters() if p.grad is None] for m in self.stage_modules]
        self._sent = set()

    def sent(self, stage_id: int, grads: Sequence[torch.Tensor | None]) -> None:
        if any(g is not None for g in grads):
            self._sent.add(stage_id)

    def end(self) -> None:
        # per stage, 1 where no rank holding it sent a gradient (stage 0 sends none: 0), then 1 where no rank
        # holding it added balancing losses (a mixture of experts': they reach its parameters and inputs)
        flags = torch.ones(2, self.num_stages, dtype=torch.int32, device=self.device)
        flags[0, 0] = 0
        for stage_id, module in zip(self.stage_ids, self.stage_modules):
            if stage_id in self._sent:
                flags[0, stage_id] = 0
            if getattr(module, "balancing_sum", 0.0):
                flags[1, stage_id] = 0
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        silent, unbalanced = flags.tolist()
        gradless, self._gradless = self._gradless, []
        for stage_id, params in zip(self.stage_ids, gradless):
            # reached by nothing: a later stage sent no gradient, and no stage from here to it had losses of its own
            for t in range(stage_id + 1, self.num_stages):
                if not unbalanced[t - 1]:
                    break
                if silent[t]:
                    for p in params:
                        p.grad = None
                    break
