"""Train a transformer of your own under MegaScaleStrategy: tensor, pipeline and ZeRO parallelism come from
what the model declares, not from megascale's GPT.

The model below is written with plain torch (a Llama-style decoder: RMSNorm, rotary attention with grouped
query heads, SwiGLU) and declares three things (docs/guides/lightning.md, "Your own model"):

- ``tensor_parallel_plan``: which linear layers are split by columns or rows, which norms run on sequence
  shards; megascale adds sequence parallelism and chunked comm/GEMM overlap to every column-then-row pair;
- ``pipeline_layers()`` and ``pipeline_loss()``: its layers in order, cut into pipeline stages (and used as
  ZeRO units and activation-checkpointing blocks);
- ``init_weights()``: how it initialises itself after it was built on the meta device and split.

It trains on the Python standard library's source (byte tokens), on 4 CPU processes by default:

    python examples/own_model.py                                   # tp2 × pp2, ~1 minute on 2 cores
    python examples/own_model.py --tp 2 --pp 1 --zero-stage 3      # tp2 × dp2, ZeRO-3
    python examples/own_model.py --devices 1                       # one process

tests/lightning/test_own_module.py runs it for a few steps.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import ClassVar

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import nn

from megascale.core.model import PipelineLayers
from megascale.lightning import MegaScaleStrategy, TokenDataModule


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding of (B, H, T, hd), positions 0..T-1 (computed, so nothing to initialise)."""
    T, hd = x.shape[-2], x.shape[-1]
    freqs = base ** (-torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
    angles = torch.arange(T, device=x.device, dtype=torch.float32)[:, None] * freqs  # (T, hd/2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        # B, T from the projections: under sequence parallelism x holds this rank's T/tp positions only, the
        # projections see them all; -1 heads: under tensor parallelism this rank computes its share of them
        B, T = q.shape[:2]
        q = rotate(q.view(B, T, -1, self.head_dim).transpose(1, 2))  # (B, H, T, hd)
        k = rotate(k.view(B, T, -1, self.head_dim).transpose(1, 2))  # (B, KV, T, hd)
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_gate = nn.Linear(dim, hidden, bias=False)
        self.w_up = nn.Linear(dim, hidden, bias=False)
        self.w_down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, heads, kv_heads)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Output(nn.Module):
    """Final norm and vocabulary projection: the pipeline's last layer."""

    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim)
        self.proj = nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


class Transformer(nn.Module):
    """A small Llama-style decoder of our own, declaring how megascale may split it."""

    tensor_parallel_plan: ClassVar[dict[str, str]] = {
        "tok_embeddings": "rowwise",  # vocabulary-parallel; enters the sequence-parallel region
        "layers.*.attention_norm": "sequence_parallel",
        "layers.*.attention.wq": "colwise",
        "layers.*.attention.wk": "colwise",
        "layers.*.attention.wv": "colwise",
        "layers.*.attention.wo": "rowwise",
        "layers.*.ffn_norm": "sequence_parallel",
        "layers.*.feed_forward.w_gate": "colwise",
        "layers.*.feed_forward.w_up": "colwise",
        "layers.*.feed_forward.w_down": "rowwise",
        "output.norm": "sequence_parallel",
        "output.proj": "colwise_rep",  # the whole vocabulary's logits on every rank, for F.cross_entropy
    }

    def __init__(
        self, vocab: int = 256, dim: int = 128, layers: int = 4, heads: int = 4, kv_heads: int = 2
    ) -> None:
        super().__init__()
        self.n_layers = layers
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Layer(dim, heads, kv_heads, 4 * dim) for _ in range(layers))
        self.output = Output(dim, vocab)

    def pipeline_layers(self) -> PipelineLayers:
        return PipelineLayers(first=[self.tok_embeddings], blocks=list(self.layers), last=[self.output])

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.output(x)
        return logits if targets is None else self.pipeline_loss(logits, targets)

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 style: N(0, 0.02), residual projections scaled by 1/sqrt(2·layers), norms 1. Runs once the
        model was built on the meta device and split; megascale hands it whole tensors and keeps each rank's
        shard of them, so every layout starts from the values one process would draw."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith(("wo.weight", "w_down.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.n_layers))
            else:
                nn.init.normal_(p, std=0.02)


class OwnModelModule(LightningModule):
    def __init__(self, lr: float = 3e-3, vocab: int = 256, dim: int = 128, layers: int = 4, heads: int = 4,
                 kv_heads: int = 2) -> None:  # fmt: skip
        super().__init__()
        self.lr = lr
        self.sizes = dict(vocab=vocab, dim=dim, layers=layers, heads=heads, kv_heads=kv_heads)
        self.model: Transformer | None = None

    def configure_model(self) -> None:
        if self.model is None:  # under MegaScaleStrategy on the meta device: nothing allocated yet
            self.model = Transformer(**self.sizes)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        assert self.model is not None
        loss = self.model(*batch)  # with pp > 1 this call is the whole pipeline step, backward included
        self.log("train/loss", loss.detach(), prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)


class LossRecorder(Callback):
    """The logged training loss after each step (for the summary line)."""

    reads_weights_between_steps = False  # it reads a metric, not weights (see MegaScaleStrategy, ZeRO-1)

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: object, batch: object,
                           batch_idx: int) -> None:  # fmt: skip
        self.losses.append(float(trainer.callback_metrics["train/loss"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--zero-stage", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args(argv)
    if args.devices == 1:
        args.tp = args.pp = 1
    seed_everything(0)
    strategy = MegaScaleStrategy(tp=args.tp, pp=args.pp, zero_stage=args.zero_stage)
    trainer = Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                      gradient_clip_val=1.0, logger=False, enable_checkpointing=False, limit_val_batches=0,
                      log_every_n_steps=5, enable_model_summary=False)  # fmt: skip
    data = TokenDataModule(source="stdlib", seq_len=64, batch_size=8, max_bytes=2_000_000)
    record = LossRecorder()
    trainer.callbacks.append(record)  # type: ignore[attr-defined]
    trainer.fit(OwnModelModule(), datamodule=data)
    losses = record.losses
    if trainer.is_global_zero:
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        print(
            f"layout dp{strategy.dims.dp} × pp{args.pp} × tp{args.tp}, ZeRO-{args.zero_stage}: loss {first:.3f} → {last:.3f}"
        )
        if not last < first:
            print("the loss did not fall", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
