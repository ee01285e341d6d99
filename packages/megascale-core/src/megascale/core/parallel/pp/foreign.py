"""Parameters another pipeline stage holds, used by this one: a tie torch cannot see.

A layer that reaches another layer's weight other than as a parameter of its own (a head computing
``F.linear(x, self._embed[0].weight)`` through a list, a closure, a function argument) ties the two without
either module showing it: under pp the layer's stage keeps a stale copy that nothing steps (built on the meta
device: a tensor with no values). ``ForeignParameters`` watches the first step's forwards of each stage
(a ``TorchFunctionMode``: only while such a tensor is still alive) and records each use; the refusal is raised
on every rank by ``verdict()`` once the first backward is done, so no stage is left waiting for another's
activations (a loop of one's own calls ``ParallelRuntime.check_first_step()``). Until then a tensor without values is replaced by zeros so that the step completes.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["ForeignParameters"]


class ForeignParameters:
    """The parameters of ``model`` no stage of this rank holds (``before``: id -> (name, holding stage, tensor)
    before the split), and their uses in this rank's forwards until ``verdict()``."""

    def __init__(
        self, before: Mapping[int, tuple[str, int, torch.Tensor]], kept: set[int], stages: list[int]
    ) -> None:
        self._foreign = {
            k: (name, stage, weakref.ref(p)) for k, (name, stage, p) in before.items() if k not in kept
        }
        self._stages = stages
        self.finding: str | None = None
        self._settled = False

    def _alive(self) -> dict[int, tuple[str, int, torch.Tensor]]:
        """The foreign tensors still alive (held while watched: an id is not reused meanwhile)."""
        out = {}
        for k, (name, stage, ref) in self._foreign.items():
            p = ref()
            if p is not None:
                out[k] = (name, stage, p)
        return out

    def watch(self) -> Any:
        """A context for a stage's forward: records (and stands in for) the uses of foreign parameters, while
        the first step lasts and any is still alive; nothing otherwise."""
        alive = self._alive()
        if not alive:
            self._foreign = {}
            return nullcontext()
        return _Watch(self, alive)

    def record(self, name: str, holder: int) -> None:
        if self.finding is None:
            where = f"stage {self._stages[0]}" if len(self._stages) == 1 else f"stages {self._stages}"
            self.finding = (
                f"pipeline parallelism: pipeline {where} used parameter {name!r}, which stage "
                f"{holder} holds: a layer reaches another layer's weight other than as a parameter of its own "
                "(through a list, a closure or an argument), a tie that stays hidden, so this stage would use a "
                "copy nobody trains; make it a parameter of the layer using it (e.g. self.proj.weight = "
                "embed.weight: tied across the first and last stage, its gradients are summed) or use pp=1"
            )

    def stop_watching(self) -> None:
        """After the first training step's forwards (what they found is kept for ``verdict``)."""
        self._foreign = {}

    def verdict(self) -> None:
        """Every rank, once the first step's forward and backward are done: raise what any rank recorded."""
        if self._settled:
            return
        self._settled = True
        self.stop_watching()
        found = [self.finding] if self.finding else []
        if dist.is_initialized():
            texts: list[str | None] = [None] * dist.get_world_size()
            dist.all_gather_object(texts, self.finding)
            found = [t for t in texts if t is not None]
        if found:
            raise ValueError(found[0])


class _Watch(TorchFunctionMode):
    def __init__(self, owner: ForeignParameters, alive: dict[int, tuple[str, int, torch.Tensor]]) -> None:
        super().__init__()
        self.owner, self.alive = owner, alive

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        used = [x for x in flat if isinstance(x, torch.Tensor) and id(x) in self.alive]
        if used:
            for x in used:
                self.owner.record(*self.alive[id(x)][:2])
            device = next((x.device for x in flat if isinstance(x, torch.Tensor) and not x.is_meta), None)

            def stand_in(x: Any) -> Any:  # no values (meta): zeros, so that the step completes
                if isinstance(x, torch.Tensor) and id(x) in self.alive and x.is_meta and device is not None:
                    return torch.zeros(x.shape, dtype=x.dtype, device=device)
                return x

            args, kwargs = tree_map(stand_in, (args, kwargs))
        return func(*args, **kwargs)
