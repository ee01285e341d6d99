"""The attention of a context-parallel rank: its queries against the keys/values they may see.

A rank holds two chunks of each sequence (``sharding.py``). Its queries and keys are rotated at their
positions in the whole sequence, the keys/values it lacks are brought in (``kv_exchange.py``: all of them
for full causal attention, only the window's tails for a sliding window), and the causal/window mask is built
from positions rather than from indices: query at position t sees keys at s with t − window < s ≤ t, the
same rule as ``kernels.attention``. Every key a query sees is on its rank, so the softmax needs no merging
across ranks.

Attention runs block by block over the runs of consecutive positions (``block_attention.py``), skipping the
blocks no query sees and masking only the blocks the diagonal or the window's edge cuts, so nothing quadratic
in the sequence is kept (a dense mask over the rank's queries and all keys would be s²/cp bytes). On a GPU the
blocks are one FlexAttention call with a block mask over the same positions.

Packed documents: the model passes every layer the whole sequences' ``position_ids`` (restarting at 0 at each
document), as it passes the whole tokens. A rank takes the rotary angles at its chunks' positions in their
documents (``rope_tables_at``) and gives ``attention`` the document ids of its queries and of the keys it holds
or brings in, so that each query sees only its own document's keys (the halo stays what the window needs: a
document boundary only removes keys).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch
from torch.distributed import ProcessGroup

from megascale.core.kernels import document_ids
from megascale.core.kernels.documents import cached
from megascale.core.parallel.cp.balance import LayoutOfStep, SequenceLayout, head_tail
from megascale.core.parallel.cp.block_attention import BlockPlan, block_attention, block_plan
from megascale.core.parallel.cp.kv_exchange import HaloPlan, choose, exchange_halo, gather_kv
from megascale.core.parallel.wait_timer import WaitTimer, untimed

__all__ = ["ContextParallel", "attention_mask"]


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """(queries, keys) boolean mask, True where the query at ``q_pos[i]`` may attend the key at ``k_pos[j]``."""
    q, k = q_pos.unsqueeze(1), k_pos.unsqueeze(0)
    mask = k <= q
    if window is not None:
        mask &= k > q - window
    return mask


@lru_cache(maxsize=64)
def _plan(layout: SequenceLayout, rank: int, window: int | None) -> tuple[HaloPlan | None, BlockPlan]:
    """How this rank gets its keys (the halo plan, or None: all-gather) and which blocks it computes."""
    local_len = layout.seq_len // layout.cp
    halo = choose(local_len, layout.cp, window) if layout.is_head_tail else None
    k_pos = _key_positions(layout, rank, halo)
    return halo, block_plan(tuple(layout.indices(rank).tolist()), tuple(k_pos.tolist()), window)


def _key_positions(layout: SequenceLayout, rank: int, halo: HaloPlan | None) -> torch.Tensor:
    """Positions in the whole sequence of the keys a rank attends over, in the order they are brought in."""
    if halo is None:  # gathered in rank order
        return torch.cat([layout.indices(r) for r in range(layout.cp)])
    return torch.cat((halo.positions(rank), layout.indices(rank)))


@dataclass(eq=False)
class ContextParallel:
    """What one attention layer of a context-parallel rank needs: the cp group, its rank and size.

    ``SelfAttention`` calls ``rope_tables`` and ``attention`` when it holds one (``apply_context_parallel``
    sets it); ``wait_timer`` spans the waits on other ranks' keys/values (kinds ``"cp-all-gather"``,
    ``"cp-reduce-scatter"``, ``"cp-halo"``).
    """

    group: ProcessGroup
    rank: int
    size: int
    wait_timer: WaitTimer = field(default=untimed)
    # set by a trainer whose batch brings position_ids (packed documents): attention without them is refused
    documents_expected: bool = False
    # the step's layout, shared with the model's embedding and loss (megascale's GPT); None: head and tail
    step: LayoutOfStep | None = None

    def layout(self, local_len: int) -> SequenceLayout:
        """Which blocks of the whole sequence this step's ranks hold (``balance.py``)."""
        seq_len = local_len * self.size
        return head_tail(seq_len, self.size) if self.step is None else self.step.layout(seq_len)

    def positions(self, local_len: int, device: torch.device | str) -> torch.Tensor:
        """Positions in the whole sequence of this rank's ``local_len`` tokens."""
        return self.layout(local_len).indices(self.rank, device)

    def rope_tables(
        self, cos: torch.Tensor, sin: torch.Tensor, local_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of the rotary tables at this rank's positions."""
        pos = self.positions(local_len, cos.device)
        if local_len * self.size > cos.shape[0]:
            raise ValueError(
                f"a context-parallel sequence of {local_len} × cp={self.size} = {local_len * self.size} tokens is "
                f"longer than max_seq_len={cos.shape[0]}"
            )
        return cos[pos], sin[pos]

    def _documents(
        self, position_ids: torch.Tensor, layout: SequenceLayout, halo: HaloPlan | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The document ids of this rank's queries and of the keys it attends over."""
        ids = document_ids(position_ids)
        k_pos = _key_positions(layout, self.rank, halo).to(ids.device)
        return layout.shard(ids, self.rank), ids[:, k_pos]

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's chunks of a whole-sequence tensor (``position_ids``, targets, a mask's rows)."""
        if x.shape[dim] % self.size:
            raise ValueError(f"a sequence of {x.shape[dim]} tokens does not split over cp={self.size} ranks")
        return self.layout(x.shape[dim] // self.size).shard(x, self.rank, dim)

    def rope_tables_at(
        self, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed documents: the rows of the rotary tables at this rank's tokens' positions in their documents,
        (B, T/cp, hd/2), from the whole sequences' ``position_ids`` (B, T)."""
        local = self.shard(position_ids)
        return cos[local], sin[local]

    @torch.compiler.disable  # collectives and a plan of Python blocks: eager inside a compiled block
    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        window: int | None,
        scale: float | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q (B, T/cp, H, hd), k and v (B, T/cp, KV, hd), already rotated → (B, T/cp, H, hd).

        ``position_ids`` (B, T), the whole sequences' (packed documents, restarting at 0 at each): every query
        then sees only the keys of its own document."""
        local_len, kv_heads = q.shape[1], k.shape[2]
        if position_ids is None and self.documents_expected:
            raise ValueError(
                "this batch packs documents (it brings position_ids), but an attention layer called "
                "context_parallel.attention without them, so its queries would see other documents' keys: pass "
                "position_ids=<the whole sequences' position_ids> (docs/guides/core.md, 'Context parallelism')"
            )
        if position_ids is not None and position_ids.shape != (q.shape[0], local_len * self.size):
            raise ValueError(
                f"context_parallel.attention takes the whole sequences' position_ids, (B, T) = "
                f"{(q.shape[0], local_len * self.size)} for {local_len} local tokens × cp={self.size}; got "
                f"{tuple(position_ids.shape)}"
            )
        kv = torch.cat((k, v), dim=2)  # one exchange for both
        layout = self.layout(local_len)
        halo, blocks = _plan(layout, self.rank, window)
        if halo is None:
            kv_all = gather_kv(kv, self.group, timer=self.wait_timer)
        else:
            kv_all = torch.cat(
                (exchange_halo(kv, halo, self.rank, self.group, timer=self.wait_timer), kv), dim=1
            )
        k_all, v_all = kv_all.split(kv_heads, dim=2)
        documents = None
        if position_ids is not None:  # once per microbatch, for every layer (and its block masks)
            documents = cached(
                position_ids, ("cp documents", self.rank, layout, halo),
                lambda: self._documents(position_ids, layout, halo),
            )  # fmt: skip
        return block_attention(q, k_all, v_all, blocks, scale, documents=documents)
