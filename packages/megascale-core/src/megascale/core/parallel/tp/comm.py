"""Autograd-aware collectives at the edges of tensor-parallel regions (Megatron's f and g operators).

Activations are (B, T, ...); the sequence-parallel (SP) shard of rank r holds positions [r·T/tp, (r+1)·T/tp).

    copy_to_tp_region          forward: identity          backward: all-reduce     (input replicated on tp)
    reduce_from_tp_region      forward: all-reduce        backward: identity
    gather_from_sp_region      forward: all-gather on T   backward: reduce-scatter on T
    reduce_scatter_to_sp_region forward: reduce-scatter T backward: all-gather on T
    gather_to_replicated_region forward: all-gather on T  backward: this rank's slice of T (× grad_scale)
    split_to_sp_region         forward: this rank's slice backward: all-gather on T (× grad_scale)

The last two bracket a region that every rank of the group computes whole and alike (a mixture of experts
under SP or context parallelism): its output gradients are all-gathered, so every rank back-propagates the same
whole gradient, and each keeps its own slice of the input's. ``grad_scale``: context parallelism's ranks
differentiate cp × their own part of the loss (``cp.loss``): the region's gathered gradient is divided by cp
and its input's slice multiplied back.

``copy_to_tp_region`` also serves replicated weights used on sequence shards (norms, row-parallel biases under
SP): each rank's gradient covers only its tokens, and the backward all-reduce makes it the full gradient.

Each takes a ``timer`` (``wait_timer.py``) that spans the blocking collective of forward and backward as a
wait of kind ``"tp-all-reduce"``, ``"tp-all-gather"`` or ``"tp-reduce-scatter"`` (straggler detection);
the layer calling them owns it. Default: untimed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from megascale.core.parallel.wait_timer import WaitTimer, untimed

__all__ = [
    "SequenceSplitOverMesh",
    "all_gather_flat",
    "all_gather_seq",
    "copy_to_tp_region",
    "gather_from_sp_region",
    "gather_to_replicated_region",
    "reduce_from_tp_region",
    "reduce_scatter_flat",
    "reduce_scatter_seq",
    "reduce_scatter_to_sp_region",
    "split_to_sp_region",
]


# torch 2.13 renamed the flat-tensor collectives (the old names warn); releases before it have only the old.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""all_gather_flat(out, x, group, async_op): out (world·x.shape[0], ...) holds every rank's x in rank order."""
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""reduce_scatter_flat(out, x, op, group, async_op): x (world·out.shape[0], ...); rank r gets the sum of
every rank's r-th block."""


def all_gather_seq(x: torch.Tensor, group: ProcessGroup, *, timer: WaitTimer = untimed) -> torch.Tensor:
    """(B, T/tp, ...) shards → (B, T, ...), rank order along the sequence."""
    tp = dist.get_world_size(group)
    x = x.contiguous()
    out = x.new_empty((tp * x.shape[0], *x.shape[1:]))
    with timer("tp-all-gather"):
        all_gather_flat(out, x, group=group)
    return out.view(tp, *x.shape).movedim(0, 1).flatten(1, 2)  # (B, tp, T/tp, ...) → (B, T, ...)


def reduce_scatter_seq(x: torch.Tensor, group: ProcessGroup, *, timer: WaitTimer = untimed) -> torch.Tensor:
    """(B, T, ...) partial sums → this rank's (B, T/tp, ...) shard of their total."""
    tp = dist.get_world_size(group)
    B, T = x.shape[:2]
    if T % tp:
        raise ValueError(
            f"sequence parallelism splits the sequence over tp={tp} ranks, but the sequence has {T} tokens: "
            f"use a sequence length divisible by {tp}, or sequence_parallel=False"
        )
    chunks = x.reshape(B, tp, T // tp, *x.shape[2:]).movedim(1, 0).contiguous()  # (tp, B, T/tp, ...)
    out = x.new_empty(chunks.shape[1:])
    with timer("tp-reduce-scatter"):
        reduce_scatter_flat(out, chunks.flatten(0, 1), group=group)
    return out


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, timer: WaitTimer) -> torch.Tensor:
        ctx.group, ctx.timer = group, timer
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        with ctx.timer("tp-all-reduce"):
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, timer: WaitTimer) -> torch.Tensor:
        x = x.contiguous().clone()
        with timer("tp-all-reduce"):
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, timer: WaitTimer) -> torch.Tensor:
        ctx.group, ctx.timer = group, timer
        return all_gather_seq(x, group, timer=timer)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_seq(grad, ctx.group, timer=ctx.timer), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, timer: WaitTimer) -> torch.Tensor:
        ctx.group, ctx.timer = group, timer
        return reduce_scatter_seq(x, group, timer=timer)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather_seq(grad, ctx.group, timer=ctx.timer), None, None


def _own_slice(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(tp, dim=1)[rank].contiguous()


class _GatherToReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, timer: WaitTimer, scale: float) -> torch.Tensor:
        ctx.group, ctx.scale = group, scale
        return all_gather_seq(x, group, timer=timer)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        piece = _own_slice(grad, ctx.group)
        return (piece if ctx.scale == 1 else piece * ctx.scale), None, None, None


class _SplitToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, timer: WaitTimer, scale: float) -> torch.Tensor:
        ctx.group, ctx.timer, ctx.scale = group, timer, scale
        return _own_slice(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        whole = all_gather_seq(grad, ctx.group, timer=ctx.timer)
        return (whole if ctx.scale == 1 else whole * ctx.scale), None, None, None


def gather_to_replicated_region(
    x: torch.Tensor, group: ProcessGroup, *, timer: WaitTimer = untimed, grad_scale: float = 1.0
) -> torch.Tensor:
    return _GatherToReplicated.apply(x, group, timer, grad_scale)


def split_to_sp_region(
    x: torch.Tensor, group: ProcessGroup, *, timer: WaitTimer = untimed, grad_scale: float = 1.0
) -> torch.Tensor:
    return _SplitToSP.apply(x, group, timer, grad_scale)


def copy_to_tp_region(x: torch.Tensor, group: ProcessGroup, *, timer: WaitTimer = untimed) -> torch.Tensor:
    return _CopyToRegion.apply(x, group, timer)


def reduce_from_tp_region(
    x: torch.Tensor, group: ProcessGroup, *, timer: WaitTimer = untimed
) -> torch.Tensor:
    return _ReduceFromRegion.apply(x, group, timer)


def gather_from_sp_region(
    x: torch.Tensor, group: ProcessGroup, *, timer: WaitTimer = untimed
) -> torch.Tensor:
    return _GatherFromSP.apply(x, group, timer)


def reduce_scatter_to_sp_region(
    x: torch.Tensor, group: ProcessGroup, *, timer: WaitTimer = untimed
) -> torch.Tensor:
    return _ReduceScatterToSP.apply(x, group, timer)


@dataclass(frozen=True)
class SequenceSplitOverMesh:
    """A sequence split over the ranks of ``mesh`` (1-D), as a ``MoE`` layer routes it (``model.moe.SequenceSplit``):
    gathered whole, the output split again. Gradients through the gather are scaled by ``grad_scale`` and back
    by its inverse (context-parallel ranks differentiate cp × their part of the loss)."""

    mesh: DeviceMesh
    grad_scale: float = 1.0

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return gather_to_replicated_region(x, self.mesh.get_group(), grad_scale=self.grad_scale)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        return split_to_sp_region(x, self.mesh.get_group(), grad_scale=1.0 / self.grad_scale)
