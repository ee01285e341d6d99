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


class RotaryCausalAttention(nn.Module):
    """A user's causal self-attention with rotary positions and grouped-query heads, written for context
    parallelism as docs/guides/core.md shows: ``context_parallel`` (None unless the layout sets it) gives the
    tokens' positions in the whole sequence and attends over the keys the other ranks hold."""

    context_parallel = None

    def __init__(self, width: int, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.qkv = nn.Linear(width, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.out = nn.Linear(heads * self.head_dim, width, bias=False)

    def _rotate(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        half = self.head_dim // 2
        freq = 1.0 / 10000 ** (torch.arange(half, device=x.device) / half)
        angle = pos.unsqueeze(1).float() * freq  # (T, half)
        cos, sin = angle.cos().unsqueeze(1), angle.sin().unsqueeze(1)  # (T, 1, half)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(
            [self.heads * self.head_dim, *[self.kv_heads * self.head_dim] * 2], dim=-1
        )
        q = q.view(B, T, self.heads, self.head_dim)
        k, v = (t.view(B, T, self.kv_heads, self.head_dim) for t in (k, v))
        cp = self.context_parallel
        pos = cp.positions(T, x.device) if cp is not None else torch.arange(T, device=x.device)
        q, k = self._rotate(q, pos), self._rotate(k, pos)
        if cp is not None:
            y = cp.attention(q, k, v, window=None)
        else:
            y = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
            ).transpose(1, 2)
        return self.out(y.reshape(B, T, -1))


class AttentionBlock(nn.Module):
    """Pre-norm attention, then a pre-norm MLP, each residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = RotaryCausalAttention(width)
        self.mlp = MLPBlock(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x + self.attn(self.norm(x)))


class NextTokenCE(nn.Module):
    """The mean next-token cross-entropy as a module (what a context_parallel_plan's "loss" names)."""

    ignore_index = -100

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=self.ignore_index)


class AttentionLM(LayeredLM):
    """A user's transformer that declares a context_parallel_plan (docs/guides/core.md)."""

    def __init__(self, vocab: int = 64, width: int = 32, layers: int = 2) -> None:
        super().__init__(vocab, width, [AttentionBlock(width) for _ in range(layers)], Head(width, vocab))
        self.loss_fn = NextTokenCE()
        self.context_parallel_plan = {"tokens": "embed", "attention": "blocks.*.attn", "loss": "loss_fn"}

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(logits, targets)
