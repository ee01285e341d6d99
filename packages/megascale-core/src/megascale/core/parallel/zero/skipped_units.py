"""ZeRO-2/3: a unit that this rank's forward passes over still gathers and reduce-scatters in step with the
ranks whose forward runs it.

FSDP2 gathers a unit's parameters when the unit runs (or when the unit before it prefetches them), and
reduce-scatters its gradients when backward passes through it. A block that one rank's data skips while
another's runs it (``if keep.any(): h = block(h)``, a per-rank LayerDrop) makes the ranks issue different
collectives: gloo fails, NCCL hangs or mixes the buffers of two units of one size. So a unit this rank passes
over runs, for FSDP, as the identity: FSDP's own pre- and post-forward on the input of the next unit that
runs (after the last one: on the root's output, or on the loss given to backward). It is then gathered and
resharded where the other ranks run it, and its backward hooks sit where its output would be: backward gathers
it and reduce-scatters its gradients (zeros from this rank, see ``used_params.py``) right after the unit that
follows, as on the other ranks. No value changes and nothing is computed. Units are expected once each per
forward, in order; entering one before the last one entered starts a new pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

__all__ = ["SkippedUnits"]


class SkippedUnits:
    """Runs FSDP's forward hooks of each unit in ``units`` (forward order) that a forward passes over.

    Hooks each unit's forward and ``root``'s end of forward; call ``start`` when the root's forward begins
    and ``before_backward`` on a loss whose backward runs inside the root's forward (manual optimization)."""

    def __init__(
        self,
        root: nn.Module,
        units: Sequence[FSDPModule],
        before_reductions: Callable[[], None] = lambda: None,
    ) -> None:
        self.units = [u for u in units if u is not root]
        # units passed over on the loss reduce-scatter before any gradient exists: told first (used_params.py)
        self._before_reductions = before_reductions
        self._next = 0  # the unit this pass expects next
        self._handles = [
            module.register_forward_pre_hook(self._entering(i), prepend=True, with_kwargs=True)
            for i, unit in enumerate(self.units)
            for module in unit._get_fsdp_state()._modules  # a unit of several layers: entered through any
        ]
        # units left after the last one run: passed over before FSDP's own end of the root's forward (so the
        # order of post-forwards is the other ranks'), the last one's backward hook added after FSDP's (so its
        # gather follows the root's, as where the unit ran)
        self._last_unit_state: Any = None
        self._handles.append(root.register_forward_hook(self._leaving_root, prepend=True))
        self._handles.append(root.register_forward_hook(self._left_root))

    def start(self) -> None:
        """A root forward begins: a new pass."""
        self._next = 0

    def before_backward(self, loss: Tensor) -> Tensor:
        """The units this pass has not run yet, passed over on ``loss`` (a backward inside the root's
        forward begins, so later units will not run before it)."""
        indices = range(self._next, len(self.units))
        if not indices:
            return loss
        (loss,), _ = self._pass_over(indices, (loss,), {}, hook_last=False)
        self._next = len(self.units)
        return self._hook_last(self.units[indices[-1]]._get_fsdp_state(), loss)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _entering(self, index: int) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if _in_backward() or index == self._next - 1:  # a recomputation; the unit just entered again
                return None
            skipped: Sequence[int] = range(self._next, index)
            if index < self._next:  # a new pass: the rest of the last one first, then this one's first units
                skipped = [*range(self._next, len(self.units)), *range(index)]
            self._next = index + 1
            return self._pass_over(skipped, args, kwargs) if skipped else None

        return hook

    def _leaving_root(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self._next >= len(self.units) or _in_backward():
            return None
        leaves, spec = tree_flatten(output)
        tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
        indices = range(self._next, len(self.units))
        passed, _ = self._pass_over(indices, tuple(leaves[i] for i in tensors), {}, hook_last=False)
        self._last_unit_state = self.units[indices[-1]]._get_fsdp_state()
        self._next = len(self.units)
        for i, tensor in zip(tensors, passed):
            leaves[i] = tensor
        return tree_unflatten(leaves, spec)

    def _left_root(self, module: nn.Module, args: Any, output: Any) -> Any:
        state, self._last_unit_state = self._last_unit_state, None
        return None if state is None else self._hook_last(state, output)

    def _hook_last(self, state: Any, output: Any) -> Any:
        """The last unit passed over gets its backward hook on ``output``, after whatever is there."""
        if torch.is_grad_enabled():
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, Tensor) and tensor.requires_grad:
                    tensor.register_hook(self._backward_begins)
        return state._register_pre_backward_hook(output)

    def _backward_begins(self, grad: Tensor) -> Tensor:
        self._before_reductions()
        return grad

    def _pass_over(
        self, indices: Sequence[int], args: tuple, kwargs: dict, hook_last: bool = True
    ) -> tuple[tuple, dict]:
        for index in indices:
            unit: Any = self.units[index]  # an FSDPModule is an nn.Module
            state = unit._get_fsdp_state()  # FSDP2 has no public call for a forward it does not run
            policy = state._mp_policy
            state._mp_policy = replace(policy, cast_forward_inputs=False)  # the identity casts nothing
            try:
                args, kwargs = state._pre_forward(unit, args, kwargs)
                # copies, not views of the inputs: an in-place op on a view would drop FSDP's backward hook
                args, kwargs = tree_map_only(Tensor, torch.clone, (args, kwargs))
                hooked = (args, kwargs) if hook_last or index != indices[-1] else ()
                state._post_forward(unit, (args, kwargs), hooked)
            finally:
                state._mp_policy = policy
        return args, kwargs


def _in_backward() -> bool:
    """Inside autograd's backward: activation checkpointing runs forwards again there, which FSDP sees as such."""
    return torch._C._current_graph_task_id() != -1
