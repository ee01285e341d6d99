"""How a pipeline step runs inside Lightning's automatic optimisation.

With pp > 1 one ``training_step`` is one whole pipeline step: the model's call runs the schedule over every
microbatch, backward included (``megascale.core.parallel.pp.apply``). Lightning's automatic optimisation
zero-grads *between* training_step and backward, which would wipe those gradients, and would not have
cleared the previous batch's before the schedule accumulated onto them. So: zero before the schedule where
Lightning zero-grads (the first batch of each accumulation window, whether or not the last window ended in an
optimizer step: an ``optimizer_step`` override may skip it), set the gradients aside across Lightning's
zero_grad, and give them back in backward (where Lightning's own backward has nothing left to do).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

__all__ = ["PipelineLoop"]


class PipelineLoop:
    """The gradient bookkeeping of pipeline steps under Lightning (see the module docstring)."""

    def __init__(self, pipeline: Any, model: nn.Module) -> None:
        self.pipeline, self.model = pipeline, model
        self._set_aside: list[tuple[Tensor, Tensor]] = []

    @contextmanager
    def step(self, accumulate_grad_batches: int, batch_idx: int) -> Iterator[None]:
        """Around one training_step (the schedule's forward and backward) of batch ``batch_idx``."""
        # Lightning divides the loss by accumulate_grad_batches before its backward; ours runs in the schedule
        self.pipeline.loss_scale = 1.0 / accumulate_grad_batches
        if batch_idx % accumulate_grad_batches == 0:  # where Lightning's closure calls zero_grad
            for p in self.model.parameters():
                p.grad = None
        yield
        self._set_aside = [(p, p.grad) for p in self.model.parameters() if p.grad is not None]
        for param, _ in self._set_aside:
            param.grad = None

    def restore_gradients(self) -> None:
        """In Lightning's backward: the gradients the schedule computed, back in place."""
        for param, grad in self._set_aside:
            param.grad = grad
        self._set_aside = []
