"""Models a user writes with plain torch, shared by the core and Lightning tests (no megascale parts, no
Lightning: tests/core runs with megascale-core alone).

``LayeredLM`` is the shape of most language models: an embedding, a ``nn.ModuleList`` of blocks, a head; it
joins pipelines by listing those layers (``pipeline_layers()``) and its loss (``pipeline_loss()``), and its own
``forward`` means the same at pp = 1. Subclasses give the blocks and the head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megascale.core.model import PipelineLayers


class Head(nn.Module):
    """Final norm and vocabulary projection."""

    def __init__(self, width: int, vocab: int, bias: bool = True) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, vocab, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


class LayeredLM(nn.Module):
    """Embedding → blocks → head, listing its layers and its loss for pipelines."""

    def __init__(self, vocab: int, width: int, blocks: list[nn.Module], head: nn.Module) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(blocks)
        self.head = head

    def pipeline_layers(self) -> PipelineLayers:
        return PipelineLayers(first=[self.embed], blocks=list(self.blocks), last=[self.head])

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return logits if targets is None else self.pipeline_loss(logits, targets)


class MLPBlock(nn.Module):
    """A pre-norm residual MLP block: a user's own layer, no megascale parts."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def full_weights(model: nn.Module, exclude: str | None = None) -> dict[str, torch.Tensor]:
    """Every weight of ``model`` whole (float32 copies), gathered from every rank: tensor-parallel shards
    joined, pipeline stages' layers united; names containing ``exclude`` left out."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    weights = {k: v.detach().float().clone() for k, v in state.items() if exclude is None or exclude not in k}
    if dist.is_initialized():  # pipeline ranks hold different layers: the model is the union
        parts: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, weights)
        for part in parts:
            assert part is not None
            for k, v in part.items():
                weights.setdefault(k, v)
    return weights
