"""How many parameters each layer of a megascale GPT holds on one tensor-parallel rank, and which layers each
pipeline rank holds: the shapes every other part of the planner counts with.

The counts follow ``megascale.core.model`` and ``megascale.core.parallel.tensor_parallel``: projections (and
their biases) are split over tp, norms and the row-parallel output bias are replicated, the embedding and the
output projection split the padded vocabulary. Pipeline stages follow ``split_blocks`` (rank r holds stages
r, r + pp, ...; the first stage also holds the embedding, the last the head).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from megascale.core.config import GPTConfig
from megascale.core.parallel.plan import split_blocks

__all__ = ["Stage", "block_parameters", "embedding_parameters", "head_parameters", "stages_of_rank"]


def _norm(config: GPTConfig, dim: int) -> int:
    return dim * (2 if config.norm == "layernorm" and config.bias else 1)


def embedding_parameters(config: GPTConfig, tp: int) -> int:
    """The token embedding's rows on one tp rank."""
    return config.padded_vocab_size * config.d_model // tp


def head_parameters(config: GPTConfig, tp: int, tied: bool = False) -> int:
    """The final norm and the output projection on one tp rank (``tied``: the projection is the embedding's
    weight, already counted)."""
    proj = 0 if tied else config.padded_vocab_size * config.d_model // tp
    return _norm(config, config.d_model) + proj


def block_parameters(config: GPTConfig, tp: int) -> int:
    """One block's parameters on one tp rank (split projections / tp, replicated norms and output bias)."""
    d, f = config.d_model, config.ffn_dim
    q, kv = config.n_heads * config.head_dim, config.kv_heads * config.head_dim
    mlp_in = 2 if config.activation == "swiglu" else 1
    split = d * (q + 2 * kv) + mlp_in * d * f + (q + f) * d  # q, k, v, gate/up, o, down weights
    if config.bias:
        split += q + 2 * kv + mlp_in * f
    elif config.qkv_bias:
        split += q + 2 * kv
    replicated = _norm(config, d) * (1 if config.parallel_block else 2)
    if config.bias:  # the output projections' bias, added once after the reduction
        replicated += d * (1 if config.parallel_block else 2)
    if config.qk_norm:
        replicated += 2 * _norm(config, config.head_dim)
    return split // tp + replicated


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its block indices, and whether it holds the embedding and/or the head."""

    index: int
    blocks: tuple[int, ...]
    first: bool
    last: bool

    def parameters(self, config: GPTConfig, tp: int) -> int:
        """Parameters of this stage on one tp rank."""
        n = len(self.blocks) * block_parameters(config, tp)
        if self.first:
            n += embedding_parameters(config, tp)
        if self.last:
            n += head_parameters(config, tp, tied=config.tie_embeddings and self.first)
        return n


def stages_of_rank(
    config: GPTConfig,
    pp: int,
    virtual_stages: int,
    pp_rank: int,
    pipeline_split: tuple[int, ...] | None = None,
) -> list[Stage]:
    """The stages pipeline rank ``pp_rank`` holds, in order (looped placement, as ``parallel.pipeline``)."""
    n = pp * virtual_stages
    blocks = _split(config.n_layers, n, pipeline_split)
    out = []
    for v in range(virtual_stages):
        s = pp_rank + v * pp
        out.append(Stage(index=s, blocks=tuple(blocks[s]), first=s == 0, last=s == n - 1))
    return out


@lru_cache(maxsize=4096)
def _split(n_layers: int, n_stages: int, split: tuple[int, ...] | None) -> tuple[tuple[int, ...], ...]:
    if n_stages == 1:
        return (tuple(range(n_layers)),)
    return tuple(tuple(b) for b in split_blocks(n_layers, n_stages, split))
