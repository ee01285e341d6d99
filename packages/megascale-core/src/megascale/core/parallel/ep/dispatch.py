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

from megascale.core.parallel.wait_timer import WaitTimer, untimed

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


def split_by_expert(counts: torch.Tensor, chunks: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Cut rows sorted by expert (``counts[e]`` rows of expert e) into ``chunks`` parts, each still sorted by
    expert and holding about 1/chunks of every expert's rows: (each part's counts (chunks, E), each part's row
    indices)."""
    base, extra = counts // chunks, counts % chunks
    parts = torch.stack([base + (c < extra).to(counts.dtype) for c in range(chunks)])  # (chunks, E)
    starts = torch.cumsum(counts, 0) - counts
    before = torch.cumsum(parts, 0) - parts  # rows of each expert in the earlier parts
    indices = []
    for c in range(chunks):
        sizes = parts[c]
        offsets = torch.cumsum(sizes, 0) - sizes
        firsts = torch.repeat_interleave(starts + before[c] - offsets, sizes)
        indices.append(firsts + torch.arange(int(sizes.sum()), device=counts.device))
    return parts, indices


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
    ranks; ``num_experts``: the layer's routed experts (all of them, not this rank's).

    ``chunks`` > 1 overlaps the exchange with the experts' computation (MegaScale-MoE's point): every expert's
    rows are cut into that many parts, each part's all-to-all is issued at once (they run asynchronously), and
    the experts compute part c while part c+1 still travels and part c−1's outputs travel back. The waits for
    the arrivals (kind ``"ep-all-to-all"``) go to ``wait_timer``, and so into megascale-ft's timelines: with
    overlap, the later parts' waits shrink. The result is the same for any ``chunks`` (each row is computed
    alone; only the grouping of rows into GEMMs changes)."""

    wait_timer: WaitTimer

    def __init__(self, group: dist.ProcessGroup, num_experts: int, chunks: int = 2) -> None:
        self.group = group
        self.wait_timer = untimed
        self.ep = dist.get_world_size(group)
        if num_experts % self.ep:
            raise ValueError(f"{num_experts} experts cannot be split over ep={self.ep} ranks")
        if chunks < 1:
            raise ValueError(f"ep_comm_chunks={chunks} must be >= 1")
        self.local_experts = num_experts // self.ep
        self.chunks = chunks

    @torch.compiler.disable  # all-to-alls of data-dependent sizes: eager inside a compiled block
    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        ep, local = self.ep, self.local_experts
        parts, indices = split_by_expert(counts, self.chunks)
        # one exchange of every part's counts: received[s, c, j] = rows rank s sends for part c to expert j
        send = parts.view(self.chunks, ep, local).transpose(0, 1).contiguous()
        received = torch.empty_like(send)
        with self.wait_timer("ep-all-to-all"):  # blocking: where a rank waits for a slower peer's tokens
            dist.all_to_all_single(received, send, group=self.group)
        splits = [(send[:, c].sum(1).tolist(), received[:, c].sum(1).tolist()) for c in range(self.chunks)]
        # every part's rows on their way at once (functional collectives: waited for where first used)
        arrivals = [
            all_to_all_single_autograd(rows.index_select(0, idx), out, into, self.group)
            for idx, (into, out) in zip(indices, splits, strict=True)
        ]
        returns = []
        for c, arrived in enumerate(arrivals):
            order = regroup_by_expert(received[:, c])
            with self.wait_timer("ep-all-to-all"):
                grouped = arrived.index_select(0, order)
            # gradients: x ep into the rows (undoing the 1/ep below for them), / ep into the expert weights
            rows_in = _ScaleGrad.apply(grouped, float(ep))
            out = _ScaleGrad.apply(experts(rows_in, received[:, c].sum(0)), 1.0 / ep)
            back = out.index_select(0, torch.argsort(order))
            into, out_splits = splits[c]
            returns.append(all_to_all_single_autograd(back, into, out_splits, self.group))
        with self.wait_timer("ep-all-to-all"):
            done = torch.cat(returns) if len(returns) > 1 else returns[0] * 1
        if self.chunks == 1:
            return done
        return done.index_select(0, torch.argsort(torch.cat(indices)))

    def __repr__(self) -> str:
        return f"AllToAllDispatcher(ep={self.ep}, local_experts={self.local_experts}, chunks={self.chunks})"
