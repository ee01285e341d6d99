"""How a pipeline step runs inside Lightning's automatic optimisation.

With pp > 1 one ``training_step`` is one whole pipeline step: the model's call runs the schedule over every
microbatch, backward included (``megascale.core.parallel.pp.apply``). Lightning's automatic optimisation
zero-grads *between* training_step and backward, which would wipe those gradients, and would not have
cleared the previous batch's before the schedule accumulated onto them. So, where Lightning zero-grads (the
first batch of each accumulation window, whether or not the last window ended in an optimizer step: an
``optimizer_step`` override may skip it), the schedule starts from no gradients, the last window's are put
back for Lightning's zero_grad to act on as the user's ``optimizer_zero_grad`` says (freed, zeroed, or kept),
the schedule's are set aside across it, and backward adds them to what it left (where Lightning's own
backward has nothing left to do). A parameter no microbatch reached then keeps a zeroed gradient, and is
stepped, as on one process.
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
        self._left: list[tuple[Tensor, Tensor]] = []

    def _take_gradients(self) -> list[tuple[Tensor, Tensor]]:
        taken: list[tuple[Tensor, Tensor]] = [
            (p, grad) for p in self.model.parameters() if (grad := p.grad) is not None
        ]
        for param, _ in taken:
            param.grad = None
        return taken

    @contextmanager
    def step(self, accumulate_grad_batches: int, batch_idx: int) -> Iterator[None]:
        """Around one training_step (the schedule's forward and backward) of batch ``batch_idx``."""
        # Lightning divides the loss by accumulate_grad_batches before its backward; ours runs in the schedule
        self.pipeline.loss_scale = 1.0 / accumulate_grad_batches
        window_start = batch_idx % accumulate_grad_batches == 0  # where Lightning's closure calls zero_grad
        last_window = self._take_gradients() if window_start else []
        yield
        self._set_aside = self._take_gradients()
        for param, grad in last_window:  # for Lightning's zero_grad, next, as on one process
            param.grad = grad

    def restore_gradients(self) -> None:
        """In Lightning's backward: the gradients the schedule computed, added to what zero_grad left."""
        self._left = [(p, grad) for p in self.model.parameters() if (grad := p.grad) is not None]
        for param, grad in self._set_aside:
            left = param.grad  # None (freed), zeros, or a hook's that keeps them: one process adds to it too
            param.grad = grad if left is None else left.add_(grad)
        self._set_aside = []

    def keep_what_zero_grad_left(self) -> None:
        """After the reduction: ZeRO-2/3 frees the gradient of a parameter no rank used where it had none when
        the schedule began (it had not: the schedule starts from none); one zero_grad left (zeroed) keeps it."""
        for param, grad in self._left:
            if param.grad is None:
                param.grad = grad
        self._left = []
