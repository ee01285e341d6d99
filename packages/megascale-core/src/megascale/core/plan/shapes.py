"""How many parameters each layer of a megascale GPT holds on one tensor-parallel rank, and which layers each
pipeline rank holds: the shapes every other part of the planner counts with.

The counts follow ``megascale.core.model`` and ``megascale.core.parallel.tp.apply``: projections (and
their biases) are split over tp, norms and the row-parallel output bias are replicated, the embedding and the
output projection split the padded vocabulary. Pipeline stages follow ``split_blocks`` (rank r holds stages
r, r + pp, ...; the first stage also holds the embedding, the last the head).

A mixture of experts (``GPTConfig.moe``, ``model/moe.py``) replaces the MLP by a router (E × D, no bias), the
routed experts' stacked gate/up/down (E × F_e × D each, no bias) and the shared experts' MLP. The router and
the routed experts are whole on every tp rank (each routes whole sequences), the shared experts are split over
tp like an MLP; under expert parallelism (``ep``) a rank holds E/ep of the routed experts (``parallel/ep``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from megascale.core.config import GPTConfig
from megascale.core.parallel.plan import split_blocks

__all__ = [
    "Stage",
    "block_parameters",
    "embedding_parameters",
    "expert_parameters",
    "head_parameters",
    "model_parameters",
    "stages_of_rank",
]


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


def expert_parameters(config: GPTConfig, ep: int = 1) -> int:
    """One MoE layer's routed experts on one of ``ep`` expert-parallel ranks (0 without a mixture of experts):
    E/ep experts of gate/up/down (SwiGLU) or up/down (GeLU), no biases."""
    if config.moe is None:
        return 0
    projections = 3 if config.activation == "swiglu" else 2
    return config.moe.num_experts // ep * projections * config.d_model * config.expert_dim


def _mlp(config: GPTConfig, width: int) -> tuple[int, int]:
    """(weights and biases split over tp, the output bias) of an MLP ``width`` wide."""
    mlp_in = 2 if config.activation == "swiglu" else 1
    split = (mlp_in + 1) * config.d_model * width + (mlp_in * width if config.bias else 0)
    return split, config.d_model if config.bias else 0


def block_parameters(config: GPTConfig, tp: int, ep: int = 1) -> int:
    """One block's parameters on one tp rank (split projections / tp, replicated norms and output bias); with a
    mixture of experts, the router and E/``ep`` routed experts (whole on every tp rank) and the shared experts'
    MLP (split over tp) in the MLP's place."""
    d = config.d_model
    q, kv = config.n_heads * config.head_dim, config.kv_heads * config.head_dim
    split = d * (q + 2 * kv) + q * d  # q, k, v, o weights
    if config.bias or config.qkv_bias:
        split += q + 2 * kv
    replicated = _norm(config, d) * (1 if config.parallel_block else 2)
    if config.bias:  # the attention output projection's bias, added once after the reduction
        replicated += d
    if config.qk_norm:
        replicated += 2 * _norm(config, config.head_dim)
    if config.moe is None:
        mlp, mlp_bias = _mlp(config, config.ffn_dim)
        split += mlp
        if not config.parallel_block:  # the parallel block's one output projection has one bias
            replicated += mlp_bias
        return split // tp + replicated
    moe = config.moe
    routed = d * moe.num_experts + expert_parameters(config, ep)
    if moe.shared_experts:
        shared, shared_bias = _mlp(config, moe.shared_experts * config.expert_dim)
        split += shared
        replicated += shared_bias
    return split // tp + replicated + routed


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its block indices, and whether it holds the embedding and/or the head."""

    index: int
    blocks: tuple[int, ...]
    first: bool
    last: bool

    def parameters(self, config: GPTConfig, tp: int, ep: int = 1) -> int:
        """Parameters of this stage on one tp rank (of ``ep`` expert-parallel ranks)."""
        n = len(self.blocks) * block_parameters(config, tp, ep)
        if self.first:
            n += embedding_parameters(config, tp)
        if self.last:
            n += head_parameters(config, tp, tied=config.tie_embeddings and self.first)
        return n

    def expert_parameters(self, config: GPTConfig, ep: int = 1) -> int:
        """Of ``parameters``: the routed experts' (split over ep; replicated over the edp ranks)."""
        return len(self.blocks) * expert_parameters(config, ep)


def model_parameters(config: GPTConfig, active: bool = False) -> int:
    """The whole model's parameters (``GPT.num_parameters``); ``active``: with a mixture of experts, those one
    token uses, top_k of each layer's routed experts (``GPT.num_parameters(active=True)``)."""
    n = stages_of_rank(config, 1, 1, 0)[0].parameters(config, 1)
    if active and config.moe is not None:
        n -= (
            config.n_layers
            * expert_parameters(config)
            * (config.moe.num_experts - config.moe.top_k)
            // config.moe.num_experts
        )
    return n


def stages_of_rank(
    config: GPTConfig,
    pp: int,
    virtual_stages: int,
    pp_rank: int,
    pipeline_split: tuple[int, ...] | None = None,
) -> list[Stage]:
    """The stages pipeline rank ``pp_rank`` holds, in order (looped placement, as ``parallel.pp``)."""
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
