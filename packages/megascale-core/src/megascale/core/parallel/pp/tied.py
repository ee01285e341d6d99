"""Weights tied across pipeline stages, Megatron's way: a tensor shared by a layer of the first stage and one of
the last (tied input/output embeddings).

The first stage holds the tensor; the last stage holds a copy under the same name (the first stage's layer,
pruned there, leaves a ``PrunedLayer`` carrying just the tied tensors, so a checkpoint names it as one
process does). Every other pairing of stages is refused. ``TiedCopies``, over the embedding group (the first
and last stage of each pipeline):

- ``sync_values``: after materialisation, the first stage takes the last stage's values: one process
  initialises the tensor through both layers, the last one's init winning, as on the last stage, which holds
  both (the first stage's layer there carrying just the tensor);
- ``sum_gradients``: after a backward and its data-parallel reduction, what each stage's gradient gained since
  the pipeline's backward began (``begin_backward``, at the first backward after the last sum) is summed over
  the two, so both copies step alike and stay equal, however many backwards and reductions a step holds
  (manual accumulation, readers after each backward); a tensor no stage gave a gradient keeps None; the copy
  is marked ``mark_counted_elsewhere``, so global norms count the tensor once; under ZeRO the sums follow its
  shards and pieces (``follow_zero``);
- ``check``: raises where the copies differ (a check, not a hope).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from megascale.core.parallel.grad_clip import mark_counted_elsewhere

if TYPE_CHECKING:
    from megascale.core.parallel.zero import ZeroRuntime

__all__ = ["TiedCopies", "tied_across_stages"]


def tied_across_stages(
    owners: dict[int, list[tuple[int, str]]], names: dict[int, str], num_stages: int, model_name: str
) -> dict[str, tuple[str, str]]:
    """{name: (first-stage layer, last-stage layer)} of the tensors shared by a first-stage and a last-stage
    layer (``owners``: id(tensor) -> [(stage, layer name)] of every layer holding it); a tensor shared by
    other stages is refused by name."""
    tied = {}
    for key, held_by in owners.items():
        stages = sorted({stage for stage, _ in held_by})
        if len(stages) == 1:
            continue
        if stages != [0, num_stages - 1]:
            layers = [layer for _, layer in held_by]
            raise ValueError(
                f"pipeline parallelism: parameter {names.get(key, '?')!r} of {model_name} is shared by layers "
                f"{layers[0]!r} and {layers[-1]!r}, which different pipeline stages hold (tied weights): only "
                "a tensor tied between the first and the last stage can be (tied embeddings); untie it or use pp=1"
            )
        first = next(layer for stage, layer in held_by if stage == 0)
        last = next(layer for stage, layer in held_by if stage == num_stages - 1)
        tied[names[key]] = (first, last)
    return tied


def _embedding_group(pp_group: dist.ProcessGroup) -> dist.ProcessGroup | None:
    """The first and last rank of this rank's pipeline (every rank calls this: the groups are made together)."""
    ranks = dist.get_process_group_ranks(pp_group)
    if len(ranks) == 2:
        return pp_group
    every: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, ranks)
    pairs = sorted({(r[0], r[-1]) for r in every if r is not None})
    mine, _ = dist.new_subgroups_by_enumeration([list(p) for p in pairs])
    return mine if dist.get_rank() in (ranks[0], ranks[-1]) else None


class TiedCopies:
    """The tensors tied across the first and last stage, on this rank (none on a middle stage)."""

    def __init__(self, model: nn.Module, names: Sequence[str], pp_group: dist.ProcessGroup) -> None:
        self.names = list(names)
        ranks = dist.get_process_group_ranks(pp_group)
        self.group = _embedding_group(pp_group)
        self.source = ranks[-1]  # the last stage's rank: its values at init are one process's
        self._is_copy = dist.get_rank() == ranks[-1]
        held = dict(model.named_parameters())
        self.params = [held[n] for n in self.names] if self.group is not None else []
        # where the model holds each (the last stage: its head, and the pruned embedding carrying it)
        self._sites = [_sites(model, p) for p in self.params]
        self._mark_copies()
        # the gradients when the backwards not summed yet began (None: none then), or None: all summed
        self._before: list[torch.Tensor | None] | None = None
        self._zero: ZeroRuntime | None = None

    def _mark_copies(self) -> None:
        if self._is_copy:
            for p in self.params:
                mark_counted_elsewhere(p)

    def follow_zero(self, zero: ZeroRuntime) -> None:
        """After ZeRO was applied: the sums follow its shards (``_follow_sharding``) and its
        pieces (stage 1's ``"elements"``: each rank holds its piece of the average only, at a place that
        differs between the stages' buckets, so the piece is made whole over dp before the sum and cut
        again after it)."""
        self._zero = zero
        self._follow_sharding()

    def _follow_sharding(self) -> None:
        """ZeRO-2/3 replaced the parameters of a stage's layers by their shards: every other place holding a
        tied tensor (the last stage's pruned embedding, outside its stage's units) takes the shard too, so a
        checkpoint and the optimizer see one tensor. Both stages shard it alike (Shard(0) over data-parallel
        meshes of one size), so the gradients sum piece by piece."""
        for i, (old, sites) in enumerate(zip(self.params, self._sites)):
            held = {id(q): q for m, leaf in sites if (q := m._parameters[leaf]) is not None and q is not old}
            if len(held) > 1:
                raise RuntimeError(
                    f"tied tensor {self.names[i]!r}: sharded into {len(held)} different tensors"
                )
            for shard in held.values():
                for m, leaf in sites:
                    m._parameters[leaf] = shard
                self.params[i] = shard
        self._mark_copies()

    def begin_backward(self) -> None:
        """Where a pipeline's backward begins: the gradients before it, unless a backward since the last sum
        holds them already (an accumulation's micro-batches)."""
        if self._before is None:
            self._before = [None if p.grad is None else _local(p.grad).detach().clone() for p in self.params]

    def sync_values(self) -> None:
        """The first stage takes the last stage's values (see the module's docstring)."""
        if self.group is None:
            return
        with torch.no_grad():
            for p in self.params:
                dist.broadcast(_local(p.data), self.source, group=self.group)

    def sum_gradients(self) -> None:
        """Sum what each tied tensor's gradient gained since ``begin_backward`` over the first and last stage
        (after the data-parallel reduction); where neither stage has one, it stays None."""
        before, self._before = self._before, None
        if self.group is None or not self.params:
            return
        before = before if before is not None else [None] * len(self.params)
        device = self.params[0].device
        present = torch.tensor([p.grad is not None for p in self.params], dtype=torch.int32, device=device)
        dist.all_reduce(present, op=dist.ReduceOp.MAX, group=self.group)
        for p, earlier, any_grad in zip(self.params, before, present.tolist()):
            if not any_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grad = _local(p.grad)
            if earlier is not None:  # summed before: only what this step's backwards added is summed now
                grad.sub_(earlier)
            piece = self._zero.gradient_piece(p) if self._zero is not None else None
            if piece is not None:  # this rank's piece, zeros around it: the whole average, over dp
                assert self._zero is not None
                dist.all_reduce(grad, group=self._zero.grad_sum_group())
            dist.all_reduce(grad, group=self.group)
            if piece is not None:  # this rank's piece again
                flat = grad.view(-1)
                flat[: piece[0]] = 0
                flat[piece[1] :] = 0
            if earlier is not None:
                grad.add_(earlier)

    def check(self) -> None:
        """Raise on both stages where the copy differs from the original."""
        if self.group is None or not self.params:
            return
        differ = torch.zeros((), dtype=torch.int32, device=self.params[0].device)
        with torch.no_grad():
            for p in self.params:
                original = _local(p.data).clone()
                dist.broadcast(original, self.source, group=self.group)
                differ |= int(not torch.equal(original, _local(p.data)))
        dist.all_reduce(differ, op=dist.ReduceOp.MAX, group=self.group)
        if differ.item():
            raise RuntimeError(
                f"tied tensors {self.names}: the last pipeline stage's copy differs from the first stage's "
                "original (were their gradients summed once before every step? ParallelRuntime.sum_tied_gradients)"
            )


def _sites(model: nn.Module, p: nn.Parameter) -> list[tuple[nn.Module, str]]:
    return [(m, leaf) for m in model.modules() for leaf, held in m._parameters.items() if held is p]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t
