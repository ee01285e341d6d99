"""The plain training loop of the ``parallelize`` tests without Lightning: the runtime's hooks in their documented
order, SGD with momentum and global-norm clipping, each rank on its share of the step's batch."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megascale.core.parallel import clip_grad_norm_


def batch(step: int, size: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 60, (size, seq), generator=gen), torch.randint(0, 60, (size, seq), generator=gen)


def train(model: nn.Module, runtime: Any, dp_rank: int, dp: int, *, pipelined: bool, steps: int, lr: float,
          max_norm: float, size: int, seq: int, weight_decay: float = 0.0) -> tuple[list[float], list[float]]:  # fmt: skip
    """The global batch's loss and the clipped gradient norm of each step (``runtime`` None: one process)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=weight_decay)
    if runtime is not None:
        runtime.zero.attach_optimizers([optimizer])
    losses, norms = [], []
    for step in range(steps):
        tokens, targets = batch(step, size, seq)
        share = size // dp
        tokens, targets = (
            tokens[dp_rank * share : (dp_rank + 1) * share],
            targets[dp_rank * share : (dp_rank + 1) * share],
        )
        loss = model(tokens, targets)
        if not pipelined:
            loss.backward()
        if runtime is not None:
            runtime.zero.after_backward()
            runtime.sum_tied_gradients()  # weights tied across pipeline stages (nothing without)
        norm = clip_grad_norm_(
            model.parameters(), max_norm, sum_group=runtime.grad_norm_group if runtime else None
        )
        norms.append(float(norm))
        if runtime is not None:
            runtime.zero.before_optimizer_step(optimizer)
        optimizer.step()
        if runtime is not None:
            runtime.zero.after_optimizer_step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        value = loss.detach().float()
        if dp > 1:  # the global batch's loss: the mean over the dp replicas
            dist.all_reduce(value, group=runtime.mesh["dp"].get_group())
            value /= dp
        losses.append(float(value))
    if runtime is not None:
        runtime.zero.wait_for_params()
    return losses, norms
