"""A LightningModule of the user's own (no megascale GPT) that opts into tensor parallelism itself.

The recipe MegaScaleStrategy documents: build the model in ``configure_model`` and, when the strategy gives a
device mesh with tp > 1, split it with DTensor's ``parallelize_module`` over ``self.device_mesh["tp"]``; the
strategy then adds ZeRO over "dp". Without a mesh (one process, any other strategy) it trains unsplit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn


class TinyTokenMLP(LightningModule):
    def __init__(self, vocab: int = 100, width: int = 32, hidden: int = 64, lr: float = 1e-2) -> None:
        super().__init__()
        self.vocab, self.width, self.hidden, self.lr = vocab, width, hidden, lr
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.model = nn.ModuleDict(
            {
                "embed": nn.Embedding(self.vocab, self.width),
                "up": nn.Linear(self.width, self.hidden),
                "down": nn.Linear(self.hidden, self.width),
                "head": nn.Linear(self.width, self.vocab),
            }
        )
        mesh = self.device_mesh
        if mesh is not None and mesh["tp"].size() > 1:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            parallelize_module(self.model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        m = self.model
        assert m is not None
        x = m["embed"](tokens)
        x = x + m["down"](F.gelu(m["up"](x)))
        return m["head"](x)

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = F.cross_entropy(self(inputs).flatten(0, 1), targets.flatten())
        self.log("train/loss", loss, on_step=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)
