"""AllToAllDispatcher: routed tokens to the ranks holding their experts, and the experts' outputs back.

Each rank holds experts ``rank·E/ep … (rank+1)·E/ep − 1`` of every MoE layer. A rank's rows arrive sorted by
expert, hence already in order of destination rank; one all-to-all of the counts tells every rank how many rows
each peer sends to each of its experts, one all-to-all with those uneven splits moves the rows, they are
regrouped by local expert (they arrive by source rank), computed, put back in arrival order and sent home by a
second all-to-all. Both all-to-alls are differentiable (backward sends the gradients the opposite way), so an
expert's gradient is the sum over every ep rank's tokens' gradients, where a dense parameter's is its own batch's:
the experts are run on their rows with gradients scaled by 1/ep on the way into their weights (and by ep back
out to the rows), so that averaging over the ranks holding the same experts ("edp", by whichever ZeRO stage)
gives the mean over all dp batches, like every other gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

if TYPE_CHECKING:
    from megascale.core.model.moe import GroupedExperts

__all__ = ["AllToAllDispatcher", "regroup_by_expert"]


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad * ctx.scale, None  # type: ignore[attr-defined]


def regroup_by_expert(counts: torch.Tensor) -> torch.Tensor:
    """Row indices that reorder rows arriving by (source rank, local expert) — ``counts[s, j]`` rows from rank
    s for expert j — into (local expert, source rank) order, so that each expert's rows are consecutive."""
    sources, experts = counts.shape
    sizes = counts.flatten()
    starts = torch.cumsum(sizes, 0) - sizes  # where each (s, j) block starts as the rows arrive
    blocks = torch.arange(sources * experts, device=counts.device).view(sources, experts).t().flatten()
    block_sizes, block_starts = sizes[blocks], starts[blocks]
    # within a block, consecutive rows: the block's start, then +1, +2, ...
    offsets = torch.cumsum(block_sizes, 0) - block_sizes
    firsts = torch.repeat_interleave(block_starts - offsets, block_sizes)
    return firsts + torch.arange(int(sizes.sum()), device=counts.device)


class AllToAllDispatcher:
    """What an ``MoE`` layer calls under expert parallelism (``MoE.dispatcher``) over ``group``, the "ep"
    ranks; ``num_experts``: the layer's routed experts (all of them, not this rank's)."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int) -> None:
        self.group = group
        self.ep = dist.get_world_size(group)
        if num_experts % self.ep:
            raise ValueError(f"{num_experts} experts cannot be split over ep={self.ep} ranks")
        self.local_experts = num_experts // self.ep

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        send = counts.view(self.ep, self.local_experts)  # rows for each rank's experts, in expert order
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self.group)  # received[s, j]: from rank s for expert j
        send_splits, receive_splits = send.sum(1).tolist(), received.sum(1).tolist()
        arrived = all_to_all_single_autograd(rows, receive_splits, send_splits, self.group)
        order = regroup_by_expert(received)
        # gradients: x ep into the rows (undoing the 1/ep below for them), / ep into the expert weights
        rows_in = _ScaleGrad.apply(arrived.index_select(0, order), float(self.ep))
        out = _ScaleGrad.apply(experts(rows_in, received.sum(0)), 1.0 / self.ep)
        back = out.index_select(0, torch.argsort(order))
        return all_to_all_single_autograd(back, send_splits, receive_splits, self.group)

    def __repr__(self) -> str:
        return f"AllToAllDispatcher(ep={self.ep}, local_experts={self.local_experts})"
