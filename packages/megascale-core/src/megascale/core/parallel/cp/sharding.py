"""Load-balanced causal sharding of a sequence over ``cp`` context-parallel ranks.

Under a causal mask the query at position t attends t + 1 keys, so contiguous slices would give the last rank
most of the work. The sequence is cut into ``2·cp`` equal chunks and rank r holds chunks r and 2·cp − 1 − r
(one early, one late: Megatron-Core's and Llama 3's balancing), which gives every rank the same number of
(query, key) pairs. Its local tokens are those two chunks back to back; ``positions`` says where each sits in
the whole sequence (the rotary angles and the causal mask are taken from it).

    tokens (B, T)  -> shard_sequence(tokens, rank, cp)  -> (B, T / cp): chunks r and 2·cp − 1 − r
"""

from __future__ import annotations

from functools import lru_cache

import torch

__all__ = ["check_sequence", "chunk_owner", "positions", "shard_sequence", "unshard_sequence"]


def check_sequence(seq_len: int, cp: int) -> None:
    """Raise ValueError unless a sequence of ``seq_len`` tokens splits into 2·cp equal chunks."""
    if seq_len % (2 * cp):
        raise ValueError(
            f"context parallelism over cp={cp} ranks cuts each sequence into 2·cp = {2 * cp} equal chunks (two per "
            f"rank, for balanced causal work), but the sequence has {seq_len} tokens: use a sequence length "
            f"divisible by {2 * cp}"
        )


def chunk_owner(chunk: int, cp: int) -> int:
    """The rank holding ``chunk`` (of 2·cp)."""
    return chunk if chunk < cp else 2 * cp - 1 - chunk


@lru_cache(maxsize=64)
def _positions(local_len: int, rank: int, cp: int) -> torch.Tensor:
    c = local_len // 2
    first, second = rank, 2 * cp - 1 - rank
    return torch.cat((torch.arange(first * c, (first + 1) * c), torch.arange(second * c, (second + 1) * c)))


def positions(local_len: int, rank: int, cp: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Positions in the whole sequence of rank ``rank``'s ``local_len`` tokens (int64, ascending)."""
    if local_len % 2:
        raise ValueError(f"a context-parallel rank holds two equal chunks; {local_len} local tokens is odd")
    return _positions(local_len, rank, cp).to(device)


def shard_sequence(x: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s chunks of ``x`` along ``dim`` (the sequence): chunks r and 2·cp − 1 − r of 2·cp."""
    if cp == 1:
        return x
    check_sequence(x.shape[dim], cp)
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat((chunks[rank], chunks[2 * cp - 1 - rank]), dim=dim)


def unshard_sequence(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's ``shard_sequence`` output, in rank order (tests, sampling)."""
    cp = len(shards)
    pieces: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, shard in enumerate(shards):
        first, second = shard.chunk(2, dim=dim)
        pieces[rank], pieces[2 * cp - 1 - rank] = first, second
    return torch.cat([p for p in pieces if p is not None], dim=dim)
