"""Which blocks of a sequence each context-parallel rank holds: head and tail, or balanced by the mask's work.

Without documents the causal work of a block grows with its position, and rank r holding chunks r and
2·cp − 1 − r of 2·cp (``sharding.py``) gives every rank the same work. Packed documents break that: a query
sees only its own document, so its work is its position in its document plus one, and documents of a few
thousand tokens in a long row leave some ranks with 1.3–1.6 times the mean work at cp 4–8 (work measured as
below, for documents of 256–2048 tokens at 8192). As torchtitan balances from its block mask, a batch of
packed documents is cut into 2·cp·k equal blocks (k up to 4), each weighed by the (query, key) pairs its
queries see in their documents, summed over the batch's rows, and dealt heaviest first to the least loaded
rank with room (2·k blocks each: every rank keeps T / cp tokens). The head-and-tail layout stays whenever
the dealt one is not 5% lighter on its heaviest rank.

The layout is the batch's (every cp rank of a replica sees the same rows, so all compute the same one), set
for a step by the model's forward (``LayoutOfStep``) and read by each piece that cuts or attends: the
embedding's tokens, the attention's positions and keys, the loss's targets. Under a pipeline its
microbatches share the step's layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache

import torch

from megascale.core.kernels.documents import cached
from megascale.core.parallel.cp.sharding import check_sequence

__all__ = ["LayoutOfStep", "SequenceLayout", "balanced_layout", "head_tail"]

LIGHTER = 0.95  # the dealt layout replaces head and tail when its heaviest rank is this much lighter


@dataclass(frozen=True)
class SequenceLayout:
    """``blocks[r]``: the (ascending) indices of the equal blocks of a ``seq_len`` sequence rank r holds."""

    seq_len: int
    blocks: tuple[tuple[int, ...], ...]

    @property
    def cp(self) -> int:
        return len(self.blocks)

    @property
    def block_len(self) -> int:
        return self.seq_len // (self.cp * len(self.blocks[0]))

    @cached_property
    def is_head_tail(self) -> bool:
        return self == head_tail(self.seq_len, self.cp)

    def indices(self, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Positions in the whole sequence of rank ``rank``'s tokens, in the order it holds them (ascending)."""
        return _indices(self, rank).to(device)

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """Rank ``rank``'s blocks of ``x`` along ``dim`` (the sequence), back to back."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(
                f"a context-parallel layout of {self.seq_len} tokens cannot cut a sequence of {x.shape[dim]}"
            )
        n = self.block_len
        return torch.cat([x.narrow(dim, b * n, n) for b in self.blocks[rank]], dim=dim)


@lru_cache(maxsize=256)
def _indices(layout: SequenceLayout, rank: int) -> torch.Tensor:
    n = layout.block_len
    return torch.cat([torch.arange(b * n, (b + 1) * n) for b in layout.blocks[rank]])


@lru_cache(maxsize=64)
def head_tail(seq_len: int, cp: int) -> SequenceLayout:
    """Chunks r and 2·cp − 1 − r of 2·cp for rank r: balanced causal work without documents."""
    check_sequence(seq_len, cp)
    return SequenceLayout(seq_len, tuple((r, 2 * cp - 1 - r) for r in range(cp)))


def _blocks_per_chunk(seq_len: int, cp: int) -> int:
    return next(k for k in (4, 2, 1) if seq_len % (2 * cp * k) == 0)


def balanced_layout(position_ids: torch.Tensor, cp: int) -> SequenceLayout:
    """The layout for a batch of packed documents (B, T) ``position_ids``: see the module docstring."""
    seq_len = position_ids.shape[1]
    k = _blocks_per_chunk(seq_len, cp)
    count = 2 * cp * k
    work = (position_ids.double() + 1).sum(0).view(count, -1).sum(1).tolist()  # one host sync per step
    per_chunk = [sum(work[c * k : (c + 1) * k]) for c in range(2 * cp)]
    head_tail_most = max(per_chunk[r] + per_chunk[2 * cp - 1 - r] for r in range(cp))
    load, owned = [0.0] * cp, [[] for _ in range(cp)]  # type: list[float], list[list[int]]
    for b in sorted(range(count), key=lambda b: (-work[b], b)):
        rank = min((r for r in range(cp) if len(owned[r]) < 2 * k), key=lambda r: (load[r], r))
        owned[rank].append(b)
        load[rank] += work[b]
    if max(load) >= LIGHTER * head_tail_most:
        return head_tail(seq_len, cp)
    return SequenceLayout(seq_len, tuple(tuple(sorted(o)) for o in owned))


@dataclass(eq=False)
class LayoutOfStep:
    """The layout of the step running now: head and tail, or dealt from its packed documents' positions
    (``position_ids``, set by the model's forward pre-hook; None: no documents)."""

    cp: int
    position_ids: torch.Tensor | None = field(default=None, repr=False)

    def layout(self, seq_len: int) -> SequenceLayout:
        ids = self.position_ids
        if ids is None or self.cp == 1:
            return head_tail(seq_len, self.cp)
        if ids.shape[1] != seq_len:
            raise ValueError(
                f"this step's position_ids cover {ids.shape[1]} tokens, but a context-parallel piece cuts "
                f"{seq_len}: the model was called with position_ids of another sequence length"
            )
        return cached(ids, ("cp layout", self.cp), lambda: balanced_layout(ids, self.cp))
