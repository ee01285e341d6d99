"""Whole gradients for user code that reads them before the optimizer step.

Under MegaScaleStrategy a gradient may be a tensor-parallel, expert-parallel or ZeRO-2/3 shard: a DTensor.
Arithmetic on it is right (a norm of a sharded DTensor is a pending sum over its shards), but reading a
number out of it is not: ``float(p.grad.norm())`` or ``.item()`` returns this rank's share, silently (0.91 where
one process reads 1.43). So while the hooks that read gradients run (``on_before_optimizer_step`` and
``configure_gradient_clipping``, and the clipping Lightning does there), each sharded gradient is gathered
whole (Replicate), and split again afterwards from what the hooks left: a gradient they scaled (their own
clipping) keeps its new values. It costs one all-gather per sharded gradient and the whole gradients held
meanwhile, paid only where such a reader exists (``weight_readers.gradient_readers``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

__all__ = ["whole_gradients"]


@contextmanager
def whole_gradients(params: Iterable[nn.Parameter]) -> Iterator[None]:
    """Inside, every sharded DTensor gradient of ``params`` is whole on every rank; outside, split as before
    (from the values inside). Every rank holding a shard of one must enter (it communicates), in the same
    order of ``params``."""
    split: list[tuple[nn.Parameter, tuple]] = []
    for p in params:
        grad = p.grad
        if not isinstance(grad, DTensor) or all(isinstance(pl, Replicate) for pl in grad.placements):
            continue
        if any(isinstance(pl, Partial) for pl in grad.placements):  # not reduced yet: nothing to read whole
            continue
        split.append((p, grad.placements))
        p.grad = grad.redistribute(grad.device_mesh, [Replicate()] * grad.device_mesh.ndim)
    try:
        yield
    finally:
        for p, placements in split:
            grad = p.grad
            if isinstance(grad, DTensor):  # a rank keeps its own slice of the whole: no communication
                p.grad = grad.redistribute(grad.device_mesh, placements)
