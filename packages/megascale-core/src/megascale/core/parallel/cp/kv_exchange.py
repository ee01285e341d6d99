"""Moving keys and values between context-parallel ranks, forward and backward.

Each rank holds the keys/values of its own tokens (two chunks of the sequence, ``sharding.py``); its queries
need more of them. Two ways, each an autograd function whose backward returns the gradients to where the
keys/values came from:

- ``gather_kv``: every rank's keys/values, all-gathered (backward: reduce-scatter). Full causal attention
  needs every earlier key, which is most of the sequence for the late chunk; this is Llama 3's all-gather
  context parallelism. Received per rank: (cp − 1) × local tokens.
- ``exchange_halo``: a sliding window of w keys needs only the w − 1 tokens before each of the rank's chunks,
  which sit at the tail of the preceding chunk(s): each rank sends exactly those tails, point to point, to the
  ranks that need them (``halo_plan``). Received per rank: at most 2 × (w − 1) tokens, whatever the sequence
  length and cp — MegaScale's sliding window is what makes this cheap.

``choose`` picks the halo whenever it moves fewer tokens than the all-gather (the same choice on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megascale.core.parallel.cp.sharding import chunk_owner
from megascale.core.parallel.tp.comm import all_gather_seq, reduce_scatter_seq
from megascale.core.parallel.wait_timer import WaitTimer, untimed

__all__ = ["HaloPlan", "choose", "exchange_halo", "gather_kv", "halo_plan"]


@dataclass(frozen=True)
class HaloPlan:
    """Which tails move: ``transfers`` are (chunk, receiving rank, tokens), sorted, each the last ``tokens``
    tokens of ``chunk`` (of 2·cp, of ``chunk_len`` tokens each), sent by the chunk's owner."""

    cp: int
    chunk_len: int
    transfers: tuple[tuple[int, int, int], ...]

    def received(self, rank: int) -> int:
        return sum(n for _, q, n in self.transfers if q == rank)

    def positions(self, rank: int) -> torch.Tensor:
        """Positions (in the whole sequence) of what ``rank`` receives, in the order ``exchange_halo`` returns."""
        parts = [torch.arange((i + 1) * self.chunk_len - n, (i + 1) * self.chunk_len)
                 for i, q, n in self.transfers if q == rank]  # fmt: skip
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def local_slice(self, chunk: int, tokens: int) -> slice:
        """Where the last ``tokens`` of ``chunk`` lie in its owner's local tensor (two chunks back to back)."""
        slot = 0 if chunk < self.cp else 1
        end = (slot + 1) * self.chunk_len
        return slice(end - tokens, end)


@lru_cache(maxsize=64)
def halo_plan(local_len: int, cp: int, window: int) -> HaloPlan:
    """The tails each rank needs for a window of ``window`` keys (the query itself included), none it holds."""
    c, halo = local_len // 2, window - 1
    need: dict[tuple[int, int], int] = {}
    for rank in range(cp):
        for j in (rank, 2 * cp - 1 - rank):
            for i in range(j - 1, -1, -1):
                tokens = min(c, halo - (j - 1 - i) * c)
                if tokens <= 0:
                    break
                if chunk_owner(i, cp) != rank:  # what a rank holds, its own keys already include
                    need[i, rank] = max(need.get((i, rank), 0), tokens)
    return HaloPlan(cp, c, tuple(sorted((i, q, n) for (i, q), n in need.items())))


def choose(local_len: int, cp: int, window: int | None) -> HaloPlan | None:
    """The halo plan when it moves fewer tokens to every rank than the all-gather would; else None."""
    if window is None or cp == 1:
        return None
    plan = halo_plan(local_len, cp, window)
    most = max(plan.received(r) for r in range(cp))
    return plan if most < (cp - 1) * local_len else None


def _renamed(timer: WaitTimer) -> WaitTimer:
    return lambda kind: timer(kind.replace("tp-", "cp-"))


class _GatherKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv: torch.Tensor, group: ProcessGroup, timer: WaitTimer) -> torch.Tensor:
        ctx.group, ctx.timer = group, timer
        return all_gather_seq(kv, group, timer=_renamed(timer))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_seq(grad.contiguous(), ctx.group, timer=_renamed(ctx.timer)), None, None


def gather_kv(kv: torch.Tensor, group: ProcessGroup, *, timer: WaitTimer = untimed) -> torch.Tensor:
    """(B, T/cp, ...) local keys/values → (B, T, ...), rank order (rank r's two chunks, then r + 1's, ...)."""
    return _GatherKV.apply(kv, group, timer)


def _p2p(sends: list[tuple[torch.Tensor, int, int]], recvs: list[tuple[torch.Tensor, int, int]],
         group: ProcessGroup, timer: WaitTimer) -> None:  # fmt: skip
    """Post every (tensor, group rank, tag) send and receive at once and wait for all of them."""
    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, peer), group, tag) for t, peer, tag in sends]
    ops += [
        dist.P2POp(dist.irecv, t, dist.get_global_rank(group, peer), group, tag) for t, peer, tag in recvs
    ]
    if not ops:
        return
    with timer("cp-halo"):
        for work in dist.batch_isend_irecv(ops):
            work.wait()


class _ExchangeHalo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv: torch.Tensor, plan: HaloPlan, rank: int, group: ProcessGroup, timer: WaitTimer):
        ctx.plan, ctx.rank, ctx.group, ctx.timer, ctx.shape = plan, rank, group, timer, kv.shape
        sends, recvs, received = [], [], []
        for i, q, n in plan.transfers:  # the tag is the chunk: each pair exchanges one tail per chunk
            if chunk_owner(i, plan.cp) == rank:
                sends.append((kv[:, plan.local_slice(i, n)].contiguous(), q, i))
            elif q == rank:
                buf = kv.new_empty((kv.shape[0], n, *kv.shape[2:]))
                recvs.append((buf, chunk_owner(i, plan.cp), i))
                received.append(buf)
        _p2p(sends, recvs, group, timer)
        if not received:
            return kv.new_empty((kv.shape[0], 0, *kv.shape[2:]))
        return torch.cat(received, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        plan, rank = ctx.plan, ctx.rank
        grad_kv = grad.new_zeros(ctx.shape)
        sends, recvs, offset = [], [], 0
        for i, q, n in plan.transfers:  # the forward's transfers, reversed: gradients go back to the owner
            if q == rank and chunk_owner(i, plan.cp) != rank:
                sends.append((grad[:, offset : offset + n].contiguous(), chunk_owner(i, plan.cp), i))
                offset += n
            elif chunk_owner(i, plan.cp) == rank:
                buf = grad.new_empty((grad.shape[0], n, *grad.shape[2:]))
                recvs.append((buf, q, i))
        _p2p(sends, recvs, ctx.group, ctx.timer)
        for buf, _, i in recvs:
            grad_kv[:, plan.local_slice(i, buf.shape[1])] += buf
        return grad_kv, None, None, None, None


def exchange_halo(
    kv: torch.Tensor, plan: HaloPlan, rank: int, group: ProcessGroup, *, timer: WaitTimer = untimed
) -> torch.Tensor:
    """(B, T/cp, ...) local keys/values → (B, received, ...): the tails of other ranks' chunks this rank's
    window needs (positions: ``plan.positions(rank)``)."""
    return _ExchangeHalo.apply(kv, plan, rank, group, timer)
