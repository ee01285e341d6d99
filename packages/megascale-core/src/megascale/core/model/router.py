"""The router of a mixture of experts: each token's top-k experts, their weights, and the balancing losses.

    scores = softmax(x Wᵣᵀ)  (or sigmoid)            one per expert
    chosen = top-k of scores (+ a balancing bias)     the bias steers the choice only, never the weights

The balancing loss α·Σᵢ fᵢ·Pᵢ is computed per sequence (fᵢ: the fraction of the sequence's choices that went
to expert i, times the number of experts; Pᵢ: its mean normalised score) and averaged over sequences, so it
is the same whatever the data-parallel or micro-batch split; the z-loss is ST-MoE's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megascale.core.config import GPTConfig, MoEConfig

__all__ = ["Router", "Routing", "in_backward"]


@dataclass
class Routing:
    """Where each of N tokens goes: ``experts`` (N, k) and their ``weights`` (N, k); the router's fp32
    ``scores`` (N, E) and ``logits`` (N, E), from which the balancing losses are computed."""

    experts: torch.Tensor
    weights: torch.Tensor
    scores: torch.Tensor
    logits: torch.Tensor


def in_backward() -> bool:
    """True while autograd's engine runs this thread's code: a forward recomputed by activation checkpointing,
    which must not count its tokens or leave losses a second time."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class Router(nn.Module):
    """Scores each token against every expert and picks its top-k (see the module docstring).

    Buffers: ``expert_bias`` (only with ``bias_update_rate`` > 0; saved with the model, so a resumed run
    chooses as the uninterrupted one) and ``tokens_per_expert``, the tokens each expert was sent by this rank's
    training forwards since the last ``update_expert_biases`` (or ``expert_load(reset=True)``).
    """

    expert_bias: torch.Tensor | None
    tokens_per_expert: torch.Tensor

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.moe is not None
        self.moe: MoEConfig = config.moe
        self.weight = nn.Parameter(torch.empty(self.moe.num_experts, config.d_model))
        bias = torch.zeros(self.moe.num_experts) if self.moe.bias_update_rate > 0 else None
        self.register_buffer("expert_bias", bias)
        self.register_buffer("tokens_per_expert", torch.zeros(self.moe.num_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> Routing:
        """Route tokens ``x`` (N, d_model)."""
        logits = F.linear(x, self.weight).float()
        scores = logits.softmax(-1) if self.moe.score == "softmax" else logits.sigmoid()
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        experts = choice.topk(self.moe.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.moe.normalize_top_k:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.training and not in_backward():
            with torch.no_grad():
                self.tokens_per_expert += torch.bincount(experts.flatten(), minlength=self.moe.num_experts)
        return Routing(experts=experts, weights=weights.to(x.dtype), scores=scores, logits=logits)

    def balancing_loss(self, routing: Routing, batch: int, seq: int) -> torch.Tensor | None:
        """α·(mean over sequences of Σᵢ fᵢ·Pᵢ) + β·mean(logsumexp(logits)²), or None when both are off."""
        moe, E, k = self.moe, self.moe.num_experts, self.moe.top_k
        loss = None
        if moe.aux_loss_coef > 0:
            probs = (
                routing.scores if moe.score == "softmax" else routing.scores / routing.scores.sum(-1, True)
            )
            chosen = F.one_hot(routing.experts, E).sum(1).float().view(batch, seq, E)  # (B, T, E) 0/1
            f = chosen.sum(1) * (E / (k * seq))  # (B, E): 1 for every expert when perfectly balanced
            p = probs.view(batch, seq, E).mean(1)  # (B, E)
            loss = moe.aux_loss_coef * (f * p).sum(-1).mean()
        if moe.z_loss_coef > 0:
            z = moe.z_loss_coef * routing.logits.logsumexp(-1).square().mean()
            loss = z if loss is None else loss + z
        return loss

    def extra_repr(self) -> str:
        return f"experts={self.moe.num_experts}, top_k={self.moe.top_k}, score={self.moe.score}"
