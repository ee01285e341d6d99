# The true global norm of gradients spread over ranks, and clipping by it.
#
# Scope: `grad_norm` and `clip_grad_norm_` for parameters that are plain tensors and/or DTensors (tensor
# parallel Shard/Replicate, FSDP2's Shard/_StridedShard on a data-parallel dimension, 2-D meshes), and the
# shared reduction `all_reduce_over_shards` that LAMB's trust-ratio norms use too.
#
# Why not torch.nn.utils.clip_grad_norm_: handed DTensors it computes the norm through DTensor ops, which is
# correct but costs one collective per tensor (each tensor's norm is reduced on its own); handed local
# tensors (what tensor-parallel code sees) it would give a norm that differs from rank to rank, so ranks of
# one model would scale their gradients differently. Here each rank computes local norms, and the only
# communication is one all-reduce per distinct (mesh dimension's) process group that some tensor is split
# over, whatever the number of tensors.
#
# Counting each tensor once: a tensor split over some mesh dimensions (any placement but Replicate) has its
# local p-th powers summed over exactly those dimensions; over a Replicate dimension every rank holds the
# same values, so summing there would count them several times. Summing over one split dimension and then
# over the next gives the sum over all shards, so a tensor split on two dimensions takes part in two
# reductions. Tensors with the same split (same mesh, same dimensions) are first summed locally, so the
# reduced vector has one entry per distinct split, not per tensor. Plain tensors are taken to be whole and
# identical on every rank that holds them (a data-parallel replica after the gradient all-reduce): they cost
# no communication. Ranks that hold different plain tensors (pipeline stages) add their shares over
# `sum_group`.
#
# Like any SPMD code, every rank of a mesh must pass the same parameters with gradients present, in the
# same order: the reductions are matched by order.

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megascale.core._dtensor import ShardSpec, is_dtensor, local, shard_spec

__all__ = ["SumGroup", "all_reduce_over_shards", "clip_grad_norm_", "grad_norm"]

SumGroup = dist.ProcessGroup | Sequence[dist.ProcessGroup] | None
"""Groups over whose ranks the local shares of a norm are added (see ``grad_norm``)."""


def all_reduce_over_shards(
    values: Tensor, specs: Sequence[ShardSpec | None], op: Any = dist.ReduceOp.SUM
) -> Tensor:
    """Reduce, in place, each entry of ``values`` over exactly the process groups of its shard spec.

    ``values[i]`` is a local partial result (a sum of squares, a maximum) of a tensor split as ``specs[i]``
    (see ``megascale.core._dtensor.shard_spec``); entries with spec None are whole already and are left
    alone. There is one all-reduce per distinct process group that some entry is split over, in order of
    first appearance, so every rank that passes the same specs issues the same collectives in the same order.
    Returns ``values``.

    Args:
        values: 1-D tensor, one entry per spec, on a device the process groups can reduce on.
        specs: for each entry, the process groups its tensor is split over, or None.
        op: ``dist.ReduceOp.SUM`` for sums of powers, ``dist.ReduceOp.MAX`` for maxima.
    """
    if values.dim() != 1 or values.numel() != len(specs):
        raise ValueError(
            f"values must be 1-D with one entry per spec; got {tuple(values.shape)}, {len(specs)}"
        )
    positions: dict[dist.ProcessGroup, list[int]] = {}
    for i, spec in enumerate(specs):
        # Keyed by the process group, not by mesh: two mesh objects over the same ranks (a 1-D TP mesh and
        # the "tp" dimension of a 2-D mesh) share one reduction.
        for group in spec or ():
            positions.setdefault(group, []).append(i)
    for group, index in positions.items():
        if len(index) == len(specs):
            dist.all_reduce(values, op=op, group=group)
        else:
            where = torch.tensor(index, device=values.device)
            part = values.index_select(0, where)
            dist.all_reduce(part, op=op, group=group)
            values.index_copy_(0, where, part)
    return values


def _grad_of(p: Tensor) -> Tensor | None:
    """The gradient of ``p`` in a form whose local values are pieces of the whole (no Partial placements).

    A DTensor parameter's gradient is normally a DTensor with the parameter's placements. A Partial gradient
    (unreduced sums, e.g. of a replicated parameter under some DTensor ops) has local values that are not
    pieces of the whole, so its norm cannot be computed from them: it is redistributed to the parameter's
    placements, one collective for that tensor alone. LAMB does the same before its update.
    """
    g: Any = p.grad
    if g is None:
        return None
    if g.is_sparse:
        raise RuntimeError("grad_norm does not support sparse gradients")
    if is_dtensor(p) and not is_dtensor(g):
        raise RuntimeError(
            "a DTensor parameter has a plain-tensor gradient: its local values cannot be placed in the "
            "whole tensor, so its share of the global norm is unknown"
        )
    if is_dtensor(g) and any(pl.is_partial() for pl in g.placements):
        if not is_dtensor(p):
            raise RuntimeError(
                f"a plain parameter has a DTensor gradient with Partial placements {g.placements}"
            )
        g = g.redistribute(p.device_mesh, p.placements)  # type: ignore[attr-defined]
    return g


COUNTED_ELSEWHERE = "_megascale_counted_elsewhere"


def mark_counted_elsewhere(p: Tensor) -> None:
    """``p`` is a copy whose gradient another rank's original holds too (tied embeddings under pp: the last
    stage's copy of the first stage's embedding): norms leave it out, clipping still scales it."""
    setattr(p, COUNTED_ELSEWHERE, True)


def _counted(params: list[Tensor]) -> list[Tensor]:
    return [p for p in params if not getattr(p, COUNTED_ELSEWHERE, False)]


def _unique_with_grads(parameters: Iterable[Tensor] | Tensor) -> list[Tensor]:
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    seen: set[int] = set()
    out = []
    for p in params:
        # A tensor listed twice (tied weights gathered from two modules) is still one tensor: count it once.
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        out.append(p)
    return out


def _check_norm_type(norm_type: float) -> float:
    norm_type = float(norm_type)
    if not (norm_type > 0):  # NaN too
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")
    return norm_type


def _local_norms(grads: list[Tensor], norm_type: float, foreach: bool | None) -> list[Tensor]:
    """fp32 norm of each local tensor (fp32 also for half-precision gradients, as the total deserves)."""
    if foreach is False:
        return [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads]
    norms: list[Tensor] = [None] * len(grads)  # type: ignore[list-item]  # all filled below
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, g in enumerate(grads):
        groups.setdefault((g.device, g.dtype), []).append(i)
    for indices in groups.values():
        out = torch._foreach_norm([grads[i] for i in indices], norm_type, dtype=torch.float32)
        for i, n in zip(indices, out):
            norms[i] = n
    return norms


def _grad_norm(
    params: list[Tensor],
    norm_type: float,
    foreach: bool | None,
    sum_group: SumGroup,
) -> Tensor:
    norm_type = _check_norm_type(norm_type)
    is_inf = math.isinf(norm_type)
    grads = [_grad_of(p) for p in params]
    local_grads = [local(g) for g in grads if g is not None]
    specs = [shard_spec(g) for g in grads if g is not None]
    norms = _local_norms(local_grads, norm_type, foreach)
    # Per device, one entry per distinct split: the local sum of p-th powers (or the maximum) of its tensors.
    per_device: dict[torch.device, dict[Any, list[Tensor]]] = {}
    spec_of: dict[Any, ShardSpec | None] = {}
    for n, spec in zip(norms, specs):
        key = spec
        spec_of[key] = spec
        per_device.setdefault(n.device, {}).setdefault(key, []).append(n)
    totals = []
    for by_spec in per_device.values():
        keys = list(by_spec)
        if is_inf:
            values = torch.stack([torch.stack(by_spec[k]).amax() for k in keys])
        elif norm_type == 2.0:
            values = torch.stack([torch.stack(by_spec[k]).square().sum() for k in keys])
        else:
            values = torch.stack([torch.stack(by_spec[k]).pow(norm_type).sum() for k in keys])
        op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
        all_reduce_over_shards(values, [spec_of[k] for k in keys], op)
        totals.append(values.amax() if is_inf else values.sum())
    device = norms[0].device if norms else torch.device("cpu")
    if not totals:
        total = torch.zeros((), dtype=torch.float32, device=device)
    else:
        stacked = torch.stack([t.to(device) for t in totals])
        total = stacked.amax() if is_inf else stacked.sum()
    for group in _groups(sum_group):
        dist.all_reduce(total, op=dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM, group=group)
    if is_inf:
        return total
    return total.sqrt() if norm_type == 2.0 else total.pow(1.0 / norm_type)


def _groups(sum_group: SumGroup) -> tuple[dist.ProcessGroup, ...]:
    if sum_group is None:
        return ()
    if isinstance(sum_group, dist.ProcessGroup):
        return (sum_group,)
    return tuple(sum_group)


def grad_norm(
    parameters: Iterable[Tensor] | Tensor,
    norm_type: float = 2.0,
    *,
    foreach: bool | None = None,
    sum_group: SumGroup = None,
) -> Tensor:
    """The norm of all gradients of ``parameters`` taken together, as if every tensor were whole.

    Each tensor counts once: DTensor gradients are reduced over exactly the mesh dimensions they are split
    over, with one all-reduce per such process group for all tensors together; plain tensors are taken to be
    whole and identical on every rank that holds them. Parameters without a gradient are skipped, one listed
    twice counts once, and a copy marked ``mark_counted_elsewhere`` (tied embeddings under pp) not at all.

    Args:
        parameters: tensors (plain or DTensor) whose ``.grad`` to measure; every rank of a mesh must pass
            the same ones, in the same order.
        norm_type: p of the p-norm, any p > 0, or ``math.inf`` for the largest absolute value.
        foreach: compute local norms with ``torch._foreach_norm`` (None, True) or one tensor at a time.
        sum_group: ranks that hold different parameters (pipeline stages) or different pieces of each
            gradient (ZeRO-1's reduce-scattered gradients, zero outside each rank's piece), whose shares are
            added (maximum for inf): a process group, several (summed over each in turn: pipeline and data
            parallel), or None if every rank passes all of the model's gradients whole.

    Returns:
        A float32 0-d tensor on the device of the first gradient, equal on all ranks.
    """
    return _grad_norm(_counted(_unique_with_grads(parameters)), norm_type, foreach, sum_group)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[Tensor] | Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    foreach: bool | None = None,
    *,
    sum_group: SumGroup = None,
) -> Tensor:
    """Scale the gradients of ``parameters`` in place so their global norm is at most ``max_norm``.

    The norm is ``grad_norm``'s (the true global norm, equal on all ranks); each gradient (its local tensor)
    is multiplied by ``min(1, max_norm / (norm + 1e-6))``, exactly as ``torch.nn.utils.clip_grad_norm_``
    does, so every rank scales by the same factor.

    Args:
        parameters: as for ``grad_norm``.
        max_norm: the largest norm left unscaled.
        norm_type: as for ``grad_norm``.
        foreach: use ``torch._foreach_*`` (None, True) or one tensor at a time (False).
        sum_group: as for ``grad_norm``.

    Returns:
        The norm before clipping (float32, 0-d).
    """
    params = _unique_with_grads(parameters)
    total = _grad_norm(_counted(params), norm_type, foreach, sum_group)
    if not params:
        return total
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    # The local tensor of every gradient, Partial ones included: scaling a sum of parts scales the sum.
    grads: list[Tensor] = [local(p.grad) for p in params]  # type: ignore[misc]
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), group_grads in groups.items():
        # A 0-d fp32 factor: half-precision gradients are scaled in their own dtype, as torch does.
        device_coef = coef.to(device)
        if foreach is False:
            for g in group_grads:
                g.mul_(device_coef)
        else:
            torch._foreach_mul_(group_grads, device_coef)
    return total
