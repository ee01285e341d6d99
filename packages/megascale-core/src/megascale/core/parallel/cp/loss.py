"""The next-token loss of a context-parallel rank: the whole sequence's mean, as one process computes it.

It is given the whole sequences' targets (every cp rank the same) and keeps its chunks of them
(``shard_sequence``), as the embedding keeps its chunks of the tokens. Each rank holds some of each
sequence's targets. The gradients of the data-parallel × context-parallel
replicas are averaged over dp·cp (every rank's parameters are the same), so for the average to be the
gradient of the whole batch's mean loss L = Σ_r S_r / N (S_r: rank r's sum over its targets, N: the targets
of all cp ranks, ``ignore_index`` excluded), rank r differentiates cp · S_r / N. The value it returns is L
itself (the same on every cp rank, what one process logs): ``l_r + (L − l_r).detach()``. One all-reduce of
two numbers over the cp group per call.

A rank whose targets are all ignored (a long masked prompt) contributes 0, without a NaN and without a host
sync: the inner loss is then taken over one real target and multiplied by its count, 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from megascale.core.model.gpt import NextTokenLoss
from megascale.core.parallel.cp.balance import LayoutOfStep
from megascale.core.parallel.cp.sharding import shard_sequence

__all__ = ["ContextParallelLoss"]


class ContextParallelLoss(NextTokenLoss):
    """Wraps a mean next-token loss module (``NextTokenLoss``, ``VocabParallelCrossEntropy``, a model's own:
    (logits, targets) -> the mean over targets != ``ignore_index``) for a cp group; a ``NextTokenLoss``
    itself, so it stands where a GPT's loss stood."""

    def __init__(self, inner: nn.Module, group: ProcessGroup, step: LayoutOfStep | None = None) -> None:
        nn.Module.__init__(self)
        self.step = step  # the step's layout (megascale's GPT); None: head and tail
        if isinstance(inner, NextTokenLoss):
            self.vocab_size, self.backend = inner.vocab_size, inner.backend
        self.inner = inner
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # a loss of a model's own: F.cross_entropy's default unless it says otherwise
        self.ignore_index = int(getattr(inner, "ignore_index", -100))

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``logits`` of this rank's chunks (B, T/cp, V), ``targets`` of the whole sequences (B, T)."""
        if self.step is None:
            targets = shard_sequence(targets, self.rank, self.size)
        else:
            targets = self.step.layout(targets.shape[1]).shard(targets, self.rank)
        valid = (targets != self.ignore_index).sum()
        safe = targets.reshape(-1).clone()
        safe[0] = torch.where(valid > 0, safe[0], torch.zeros_like(safe[0]))  # see the module docstring
        local_sum = self.inner(logits, safe.view_as(targets)) * valid
        totals = torch.stack((local_sum.detach().float(), valid.float()))
        dist.all_reduce(totals, group=self.group)
        count = totals[1].clamp(min=1)
        mine = local_sum * (self.size / count)
        return mine + (totals[0] / count - mine).detach()
