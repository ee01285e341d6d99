"""The split backward of the zero-bubble schedule (zb1p), where torch's stage leaves gaps: its B half computes
the stage's input gradients, its W half the weights' from what B saved (``torch.distributed.pipelining``).

- ``gradients_off_the_input_path``, before B: torch's W reaches only the weights on a path from the stage's
  inputs to its outputs, so a weight the loss reaches otherwise (a head reading its input detached) would get
  no gradient at all; those get theirs here, whole, from the outputs.
- ``with_accumulate_hooks``, around W: torch assigns W's gradients itself, so the parameters' post-accumulate
  hooks (where ZeRO-0/1 count a gradient's arrival and launch its bucket) are run here, as autograd runs them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining._backward import (
    _get_grad_fn_or_grad_acc as _grad_node,
)
from torch.distributed.pipelining._backward import (
    construct_reverse_graph,
    get_param_groups,
)

__all__ = ["gradients_off_the_input_path", "with_accumulate_hooks"]


def _accumulated(p: nn.Parameter, grad: torch.Tensor) -> None:
    p.grad = grad if p.grad is None else p.grad + grad
    _run_hooks(p)


def _run_hooks(p: nn.Parameter) -> None:
    for hook in (p._post_accumulate_grad_hooks or {}).values():
        hook(p)


def gradients_off_the_input_path(module: nn.Module, bwd_kwargs: dict[str, Any]) -> None:
    """Before B (``bwd_kwargs`` as torch's stage passes them): the gradients of ``module``'s weights that the
    outputs reach but not through the stage's inputs."""
    given = bwd_kwargs["output_grads"]
    pairs = [
        (o, torch.ones_like(o) if given is None else given[i])
        for i, o in enumerate(bwd_kwargs["stage_output"])
        if o.requires_grad or o.grad_fn is not None
    ]
    pairs = [(o, g) for o, g in pairs if g is not None]
    if not pairs:
        return
    outputs, grads = [o for o, _ in pairs], [g for _, g in pairs]
    weights = [p for p in module.parameters() if p.requires_grad]
    nodes = [_grad_node(p) for p in weights]
    inputs = [_grad_node(x) for x in bwd_kwargs["input_values"] if isinstance(x, torch.Tensor)]
    reverse = construct_reverse_graph([n for n in map(_grad_node, outputs) if n is not None])
    groups = get_param_groups(
        [n for n in inputs if n is not None], [n for n in nodes if n is not None], reverse
    )
    on_path = {id(n) for group in groups for n in group["params"]}
    off = [p for p, n in zip(weights, nodes) if n is not None and id(n) not in on_path]
    if not off:
        return
    found = torch.autograd.grad(outputs, off, grads, retain_graph=True, allow_unused=True)
    for p, g in zip(off, found):
        if g is not None:  # None: not reached at all, as on one process
            _accumulated(p, g)


def with_accumulate_hooks(params: Sequence[nn.Parameter], run: Callable[[], None]) -> None:
    """Run W (``run``), then the post-accumulate hooks of every parameter whose gradient it changed."""
    before = [None if p.grad is None else (id(p.grad), p.grad._version) for p in params]
    run()
    for p, was in zip(params, before):
        if p.grad is not None and (id(p.grad), p.grad._version) != was:
            _run_hooks(p)
