"""A Lightning fit on WebDataModule, run by tests/data/test_datamodule.py under torchrun (or alone).

    python tests/data/_fit_web.py SHARDS OUT.json MAX_STEPS [--save CKPT] [--resume CKPT] [--tp N]

Records every training batch each rank saw (as token lists) into OUT.json.rank<N>.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from megascale.data import Source, WebDataConfig, WebDataModule

# run as a script (sys.path[0] is tests/data): the repository's tests package
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests._dist import finish_and_exit


class TinyLM(LightningModule):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, 8), nn.Linear(8, vocab)
        self.seen: list[list[list[int]]] = []

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        self.seen.append(inputs.tolist())
        logits = self.head(self.embed(inputs))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_model(self):
        pass  # ModelParallelStrategy requires the hook; the data layout is what this script checks

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("shards")
    parser.add_argument("out")
    parser.add_argument("max_steps", type=int)
    parser.add_argument("--save")
    parser.add_argument("--resume")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (ModelParallelStrategy)")
    parser.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    args = parser.parse_args()
    torch.manual_seed(0)
    config = WebDataConfig(
        sources=[Source(args.shards)], seq_len=8, batch_size=2, lanes=4, num_workers=1, timeout=60
    )
    data = WebDataModule(config)
    model = TinyLM(data.vocab_size)
    strategy = "ddp" if args.devices > 1 else "auto"
    if args.tp > 1:
        strategy = ModelParallelStrategy(
            data_parallel_size=args.devices // args.tp, tensor_parallel_size=args.tp
        )
    trainer = Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy,
        max_steps=args.max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, datamodule=data, ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)
    with open(f"{args.out}.rank{trainer.global_rank}", "w") as f:
        json.dump(model.seen, f)
    data.teardown("fit")
    finish_and_exit()  # gloo sometimes aborts at interpreter exit (shared notes: cpu-distributed.md)


if __name__ == "__main__":
    main()
