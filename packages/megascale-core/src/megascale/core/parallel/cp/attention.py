"""The attention of a context-parallel rank: its queries against the keys/values they may see.

A rank holds two chunks of each sequence (``sharding.py``). Its queries and keys are rotated at their
positions in the whole sequence, the keys/values it lacks are brought in (``kv_exchange.py``: all of them
for full causal attention, only the window's tails for a sliding window), and the causal/window mask is built
from positions rather than from indices: query at position t sees keys at s with t − window < s ≤ t, the
same rule as ``kernels.attention``. Every key a query sees is on its rank, so the softmax needs no merging
across ranks.

Attention runs block by block over the runs of consecutive positions (``block_attention.py``), skipping the
blocks no query sees and masking only the blocks the diagonal or the window's edge cuts, so nothing quadratic
in the sequence is kept (a dense mask over the rank's queries and all keys would be s²/cp bytes). On a GPU a
FlexAttention block mask over the same positions is the fast path to add.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch
from torch.distributed import ProcessGroup

from megascale.core.parallel.cp.block_attention import BlockPlan, block_attention, block_plan
from megascale.core.parallel.cp.kv_exchange import HaloPlan, choose, exchange_halo, gather_kv
from megascale.core.parallel.cp.sharding import positions
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
def _layout(local_len: int, rank: int, cp: int, window: int | None) -> tuple[HaloPlan | None, BlockPlan]:
    """How this rank gets its keys (the halo plan, or None: all-gather) and which blocks it computes."""
    q_pos = positions(local_len, rank, cp)
    halo = choose(local_len, cp, window)
    if halo is None:
        k_pos = torch.cat([positions(local_len, r, cp) for r in range(cp)])
    else:
        k_pos = torch.cat((halo.positions(rank), q_pos))
    return halo, block_plan(tuple(q_pos.tolist()), tuple(k_pos.tolist()), window)


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

    def positions(self, local_len: int, device: torch.device | str) -> torch.Tensor:
        return positions(local_len, self.rank, self.size, device)

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

    @torch.compiler.disable  # collectives and a plan of Python blocks: eager inside a compiled block
    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        window: int | None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """q (B, T/cp, H, hd), k and v (B, T/cp, KV, hd), already rotated → (B, T/cp, H, hd)."""
        local_len, kv_heads = q.shape[1], k.shape[2]
        kv = torch.cat((k, v), dim=2)  # one exchange for both
        halo, blocks = _layout(local_len, self.rank, self.size, window)
        if halo is None:
            kv_all = gather_kv(kv, self.group, timer=self.wait_timer)
        else:
            kv_all = torch.cat(
                (exchange_halo(kv, halo, self.rank, self.group, timer=self.wait_timer), kv), dim=1
            )
        k_all, v_all = kv_all.split(kv_heads, dim=2)
        return block_attention(q, k_all, v_all, blocks, scale)
