"""Whole gradients for user code that reads them before the optimizer step.

Under MegaScaleStrategy a gradient may be a tensor-parallel, expert-parallel or ZeRO-2/3 shard: a DTensor.
Arithmetic on it is right (a norm of a sharded DTensor is a pending sum over its shards), but reading a
number out of it is not: ``float(p.grad.norm())`` or ``.item()`` returns this rank's share, silently (0.91 where
one process reads 1.43). So while the hooks that read gradients run (``on_before_optimizer_step`` and
``configure_gradient_clipping``, and the clipping Lightning does there), each sharded gradient is gathered
whole (Replicate), and split again afterwards from what the hooks left: a gradient they scaled (their own
clipping) keeps its new values. It costs one all-gather per sharded gradient and the whole gradients held
meanwhile, paid only where such a reader exists (``weight_readers.gradient_readers``). Code reading them after
the step (``on_train_batch_end``, ``weight_readers.gradient_readers_after_step``) gets them gathered whole after
each step, split again when the next training_step starts.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

__all__ = ["gather_whole", "split_again", "whole_gradients"]


Split = list[tuple[nn.Parameter, tuple]]


def gather_whole(params: Iterable[nn.Parameter]) -> Split:
    """Every sharded DTensor gradient of ``params`` gathered whole (Replicate) on every rank; returns what
    ``split_again`` needs. Every rank holding a shard of one must call it, in the same order of ``params``."""
    split: Split = []
    for p in params:
        grad = p.grad
        if not isinstance(grad, DTensor) or all(isinstance(pl, Replicate) for pl in grad.placements):
            continue
        if any(isinstance(pl, Partial) for pl in grad.placements):  # not reduced yet: nothing to read whole
            continue
        split.append((p, grad.placements))
        p.grad = grad.redistribute(grad.device_mesh, [Replicate()] * grad.device_mesh.ndim)
    return split


def split_again(split: Split) -> None:
    """The gradients ``gather_whole`` gathered, split as before from their current values (each rank keeps
    its own slice of the whole: no communication)."""
    for p, placements in split:
        grad = p.grad
        if isinstance(grad, DTensor):
            p.grad = grad.redistribute(grad.device_mesh, placements)


@contextmanager
def whole_gradients(params: Iterable[nn.Parameter]) -> Iterator[None]:
    """Inside, every sharded DTensor gradient of ``params`` is whole on every rank; outside, split as before
    (from the values inside). Every rank holding a shard of one must enter (it communicates), in the same
    order of ``params``."""
    split = gather_whole(params)
    try:
        yield
    finally:
        split_again(split)
