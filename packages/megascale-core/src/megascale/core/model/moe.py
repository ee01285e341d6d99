"""Mixture of experts: a router (``router.py``) sends each token to its top-k experts, whose MLPs run as
grouped GEMMs.

    y = Σ_{e ∈ chosen} wₑ · MLPₑ(x)  (+ shared MLP(x))

Dropless: every expert takes however many tokens chose it; the tokens are sorted by expert so that each
expert's rows are consecutive and one grouped matmul (``kernels.grouped_mm``) computes every expert at once.
Under expert parallelism a dispatcher (``megascale.core.parallel.ep``) moves the sorted rows to the ranks that
hold their experts and the outputs back; the rest of this module is the same in every layout.

Load balancing, both optional and both layout independent:
- the auxiliary loss α·Σᵢ fᵢ·Pᵢ per sequence (fᵢ: the fraction of the sequence's choices that went to expert
  i, times the number of experts; Pᵢ: its mean normalised score), averaged over sequences, and the router
  z-loss; the GPT adds them to the loss it returns (``GPT.forward(tokens, targets)``);
- auxiliary-loss-free balancing (DeepSeek-V3): the bias above, moved after each optimizer step by
  ``update_expert_biases`` from the tokens each expert got in that step, counted over every data-parallel rank.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from megascale.core import kernels
from megascale.core._dtensor import local
from megascale.core.config import GPTConfig
from megascale.core.model.mlp import MLP
from megascale.core.model.router import Router, Routing, in_backward

__all__ = [
    "GroupedExperts",
    "MoE",
    "Router",
    "Routing",
    "SequenceSplit",
    "attach_balancing_losses",
    "expert_load",
    "moe_layers",
    "take_balancing_losses",
    "update_expert_biases",
]


class GroupedExperts(nn.Module):
    """Every expert's MLP, its weights stacked (experts, out, in): ``gate``/``up``/``down`` for SwiGLU,
    ``up``/``down`` for GeLU. ``forward(rows, counts)`` runs rows sorted by expert, ``counts[e]`` of them for
    expert e. Under expert parallelism the stacks are DTensors split over the "ep" ranks (first dimension);
    this rank computes its own experts with their local part."""

    up: nn.Parameter
    down: nn.Parameter
    gate: nn.Parameter  # SwiGLU only

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.moe is not None
        E, d, f = config.moe.num_experts, config.d_model, config.expert_dim
        self.activation = config.activation
        names = ("gate", "up") if config.activation == "swiglu" else ("up",)
        for name in names:
            self.register_parameter(name, nn.Parameter(torch.empty(E, f, d)))
        self.down = nn.Parameter(torch.empty(E, d, f))
        self.mm_backend = config.kernels.get("grouped_mm")
        self.act_backend = config.kernels.get("swiglu" if config.activation == "swiglu" else "bias_gelu")

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        def mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return kernels.grouped_mm(x, local(weight), counts, backend=self.mm_backend)

        up = mm(rows, self.up)
        if self.activation == "swiglu":
            hidden = kernels.swiglu(mm(rows, self.gate), up, backend=self.act_backend)
        else:
            hidden = kernels.bias_gelu(up, None, backend=self.act_backend)
        return mm(hidden, self.down)

    def extra_repr(self) -> str:
        E, f, d = self.up.shape
        return f"experts={E}, in={d}, hidden={f}, activation={self.activation}"


class Dispatcher(Protocol):
    """Moves rows sorted by expert to the experts' ranks, runs them there and brings the outputs back in the
    same order (``megascale.core.parallel.ep``)."""

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor: ...


class SequenceSplit(Protocol):
    """A layout that gives each rank a part of every sequence (tensor parallelism's sequence shards, context
    parallelism's chunks): how the layer gathers whole sequences for its router and keeps its own part of the
    output (``megascale.core.parallel.tp.comm.SequenceSplitOverMesh``)."""

    def gather(self, x: torch.Tensor) -> torch.Tensor: ...

    def split(self, x: torch.Tensor) -> torch.Tensor: ...


class MoE(nn.Module):
    """The mixture-of-experts feed-forward: ``forward(x)`` maps (B, T, d_model) to (B, T, d_model).

    The balancing loss of the last training forward is left in ``pending_loss`` for the model holding this
    layer to add to its loss: a GPT does (``GPT.forward`` takes it); a model of your own using this layer adds
    ``take_balancing_losses(self)`` to its loss (a pipeline stage does it itself). A loss left untaken is an
    error at the next training forward, never silently dropped. ``dispatcher`` is set by expert parallelism.

    A model of your own builds it from a ``GPTConfig`` holding its widths (``d_model``, ``activation``,
    ``moe``); ``init_weights`` initialises it where the model is built on the meta device."""

    dispatcher: Dispatcher | None = None
    pending_loss: torch.Tensor | None = None
    #: set by tensor parallelism with sequence parallelism and by context parallelism: through them the layer
    #: gathers whole sequences, routes them through whole experts on every rank alike and keeps its own part
    #: of the output
    sequence_parallel_split: SequenceSplit | None = None
    context_parallel_split: SequenceSplit | None = None

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.moe is not None
        self.router = Router(config)
        self.experts = GroupedExperts(config)
        shared = config.moe.shared_experts
        self.shared = MLP(config, hidden=shared * config.expert_dim) if shared else None

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, seed: int | None = None) -> None:
        """Normal(0, std) weights (each expert's down projection ×1/√2), each parameter from a generator seeded
        by ``seed`` (default: ``torch.initial_seed()``) and its name: the same values in every layout; router
        biases and counts zero. (Inside a megascale GPT its ``init_weights`` does this instead.)"""
        base = torch.initial_seed() if seed is None else seed
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                local(param).zero_()
                continue
            scale = 2**-0.5 if name.endswith("down") or name.endswith("down.weight") else 1.0
            gen = torch.Generator().manual_seed((base + zlib.crc32(name.encode())) % 2**63)
            whole = torch.empty(param.shape, dtype=param.dtype).normal_(0.0, std * scale, generator=gen)
            _copy_whole_(param, whole)
        if self.router.expert_bias is not None:
            local(self.router.expert_bias).zero_()
        local(self.router.tokens_per_expert).zero_()
        self.pending_loss = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the balancing statistics and the routing are then those of whole sequences, as on one process (the
        # order of a sequence's tokens does not matter to them, so cp's chunks are gathered as they are)
        splits = [s for s in (self.sequence_parallel_split, self.context_parallel_split) if s is not None]
        whole = x
        for split in splits:  # tp's shards of this rank's cp chunks first, then the chunks
            whole = split.gather(whole)
        routed = self._routed(whole)
        for split in reversed(splits):
            routed = split.split(routed)
        if self.shared is not None:  # on (B, T, d) (sequence shards under SP): split over tp like any MLP
            routed = routed + self.shared(x)
        return routed

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d = x.shape
        flat = x.reshape(-1, d)
        routing = self.router(flat)
        if self.training and torch.is_grad_enabled():
            # computed again when activation checkpointing recomputes this forward (which must save the same
            # tensors as the first one), but left for the model only once
            loss = self.router.balancing_loss(routing, batch, seq)
            if not in_backward():
                if self.pending_loss is not None and loss is not None:
                    raise RuntimeError(
                        "MoE: the balancing loss of the previous training forward was never added to a loss "
                        "(aux_loss_coef/z_loss_coef > 0): add megascale.core.model.moe.take_balancing_losses(model) "
                        "to the loss you backpropagate (a megascale GPT given targets does), or set "
                        "aux_loss_coef=0 and z_loss_coef=0"
                    )
                self.pending_loss = loss
        n, k = routing.experts.shape
        chosen = routing.experts.flatten()
        order = chosen.argsort(stable=True)  # each expert's rows consecutive, tokens in order within it
        counts = torch.bincount(chosen, minlength=self.router.moe.num_experts)
        rows = flat.index_select(0, order // k)
        if self.dispatcher is None:
            out = self.experts(rows, counts)
        else:
            out = self.dispatcher(rows, counts, self.experts)
        # back to (token, choice) order and summed with the routing weights: no scatter-add, so the sum is
        # deterministic and the same in every layout
        out = out.index_select(0, order.argsort()).view(n, k, d)
        return torch.einsum("nkd,nk->nd", out, routing.weights).view(batch, seq, d)


class _AttachLoss(torch.autograd.Function):
    """Identity on ``x``; backward also sends ``scale`` to ``loss`` as its gradient: the loss joins the
    backward of whatever ``x`` flows into, weighted as that backward weighs its own loss."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.loss_shape, ctx.scale = loss.shape, scale  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        scale = ctx.scale  # type: ignore[attr-defined]
        return grad, torch.full(ctx.loss_shape, scale, dtype=torch.float32, device=grad.device), None  # type: ignore[attr-defined]


def attach_balancing_losses(
    x: torch.Tensor, model: nn.Module, scale: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` carrying the balancing losses the MoE layers under ``model`` left (taken), so that backward from
    ``x`` differentiates them with weight ``scale``; and their detached sum (None without any). What a pipeline
    stage does, whose losses cannot be added to a loss it does not compute."""
    loss = take_balancing_losses(model)
    if loss is None:
        return x, None
    return _AttachLoss.apply(x, loss, scale), loss.detach()


def _copy_whole_(param: torch.Tensor, whole: torch.Tensor) -> None:
    """``param`` (or its shard, when it is a DTensor) := ``whole`` (or the shard of it)."""
    from megascale.core._dtensor import is_dtensor

    if not is_dtensor(param):
        param.copy_(whole.to(param.device))
        return
    from torch.distributed.tensor import distribute_tensor

    mesh, placements = param.device_mesh, param.placements  # type: ignore[attr-defined]
    shard = distribute_tensor(whole.to(local(param).device), mesh, placements, src_data_rank=None)
    local(param).copy_(shard.to_local())


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers under ``model`` (this rank's: a pipeline stage holds only its blocks')."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def take_balancing_losses(model: nn.Module) -> torch.Tensor | None:
    """The sum of the balancing losses the MoE layers under ``model`` left in their last training forward
    (each taken once), or None."""
    total = None
    for layer in moe_layers(model):
        loss, layer.pending_loss = layer.pending_loss, None
        if loss is not None:
            total = loss if total is None else total + loss
    return total


@torch.no_grad()
def expert_load(
    model: nn.Module, group: dist.ProcessGroup | None = None, *, reset: bool = False
) -> torch.Tensor | None:
    """Tokens each expert of each MoE layer was sent since the last reset, (layers, experts), summed over
    ``group`` (the data-parallel ranks: every rank then holds the whole step's counts); None without MoE.
    Collective over ``group`` when given: every rank of it calls it."""
    routers = [layer.router for layer in moe_layers(model)]
    if not routers:
        return None
    counts = torch.stack([r.tokens_per_expert for r in routers])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    if reset:
        for r in routers:
            r.tokens_per_expert.zero_()
    return counts


@torch.no_grad()
def update_expert_biases(model: nn.Module, group: dist.ProcessGroup | None = None) -> torch.Tensor | None:
    """Auxiliary-loss-free balancing (DeepSeek-V3), once per optimizer step, after it: each router with
    ``bias_update_rate`` > 0 raises the bias of the experts that got fewer tokens than the mean since the last
    call and lowers the others', by that rate; the counts start again. ``group``: the data-parallel ranks
    (their counts are summed, so every replica moves its biases alike). Returns the step's counts
    (``expert_load``), for logging. Collective over ``group``: every rank calls it."""
    routers = [layer.router for layer in moe_layers(model)]
    counts = expert_load(model, group, reset=True)
    if counts is None:
        return None
    for router, load in zip(routers, counts, strict=True):
        if router.expert_bias is not None:
            step = router.moe.bias_update_rate * torch.sign(load.mean() - load)
            local(router.expert_bias).add_(step.to(router.expert_bias.dtype))
    return counts


@contextmanager
def routing_statistics_untouched(model: nn.Module) -> Iterator[None]:
    """Forwards inside count no tokens and leave no balancing loss: a forward that is not a training step's,
    such as the one torch's pipeline stages run once to infer their shapes."""
    layers = moe_layers(model)
    saved = [(layer.router.tokens_per_expert.clone(), layer.pending_loss) for layer in layers]
    try:
        yield
    finally:
        for layer, (counts, loss) in zip(layers, saved, strict=True):
            layer.router.tokens_per_expert.copy_(counts)
            layer.pending_loss = loss


def reset_router_buffers(model: nn.Module) -> None:
    """Zero every router's bias and counts (``GPT.init_weights``: on the meta device they were never set)."""
    for layer in moe_layers(model):
        if layer.router.expert_bias is not None:
            local(layer.router.expert_bias).zero_()
        local(layer.router.tokens_per_expert).zero_()
