"""The attention of a context-parallel rank: its queries against the keys/values they may see.

A rank holds two chunks of each sequence (``sharding.py``). Its queries and keys are rotated at their
positions in the whole sequence, the keys/values it lacks are brought in (``kv_exchange.py``: all of them
for full causal attention, only the window's tails for a sliding window), and the causal/window mask is built
from positions rather than from indices: query at position t sees keys at s with t − window < s ≤ t, the
same rule as ``kernels.attention``. Softmax over every key a query sees happens on one rank, so no online
softmax merging is needed.

Attention runs as torch's ``scaled_dot_product_attention`` with a boolean (local queries × keys) mask (the
reference; on a GPU a FlexAttention block mask over the same positions is the fast path to add).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

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
def _layout(local_len: int, rank: int, cp: int, window: int | None) -> tuple[HaloPlan | None, torch.Tensor]:
    """How this rank gets its keys (the halo plan, or None: all-gather) and the mask over them, on the CPU."""
    q_pos = positions(local_len, rank, cp)
    plan = choose(local_len, cp, window)
    if plan is None:
        k_pos = torch.cat([positions(local_len, r, cp) for r in range(cp)])
    else:
        k_pos = torch.cat((plan.positions(rank), q_pos))
    return plan, attention_mask(q_pos, k_pos, window)


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
        plan, mask = _layout(local_len, self.rank, self.size, window)
        if plan is None:
            kv_all = gather_kv(kv, self.group, timer=self.wait_timer)
        else:
            kv_all = torch.cat(
                (exchange_halo(kv, plan, self.rank, self.group, timer=self.wait_timer), kv), dim=1
            )
        k_all, v_all = kv_all.split(kv_heads, dim=2)
        mask = mask.to(q.device)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k_all.transpose(1, 2), v_all.transpose(1, 2), attn_mask=mask, scale=scale,
            enable_gqa=q.shape[2] != kv_heads,
        )  # fmt: skip
        return out.transpose(1, 2)
