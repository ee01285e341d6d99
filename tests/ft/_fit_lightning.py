"""A short deterministic Lightning DDP fit with `FaultTolerance`, under ``megascale-ft launch``, with faults.

    megascale-ft launch --nproc-per-node 2 -- tests/ft/_fit_lightning.py CKPT_DIR OUT.pt [--fault KIND@STEP:RANK]

A plain LightningModule (no megascale-core): each rank's batch at step s is seeded by (s, rank) and served by a
datamodule that resumes at the restored step; dropout draws from each rank's own generator (seeded per rank),
AdamW carries moments and a per-step LR schedule runs: the resumed run ends bit for bit where an uninterrupted
one does only if weights, optimizer, scheduler, loops, datamodule and every rank's RNG come back exactly.
Faults fire in the first attempt only (``MEGASCALE_FT_ATTEMPT=0``), at optimizer step STEP on rank RANK:
``sigkill`` (the process dies in training_step), ``nan`` (its loss is NaN), ``sigterm`` (SIGTERM to the
launcher, mid-step; needs ``--strategy megascale``, whose SIGTERM stop saves through FaultTolerance).
Rank 0 writes OUT.pt: {"weights": final state_dict, "restored_step": the step this attempt resumed from}.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import Any

import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer, seed_everything
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, Dataset

from megascale.ft.lightning import FaultTolerance
from tests._dist import finish_and_exit


class Batches(Dataset):
    """Item i is rank ``rank``'s whole batch of step ``start + i``."""

    def __init__(self, start: int, rank: int) -> None:
        self.start, self.rank = start, rank

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * (self.start + i) + self.rank)
        x = torch.randn(8, 16, generator=g)
        return x, x.sum(dim=1, keepdim=True).sin()


class Data(LightningDataModule):
    """Resumable: its state is the step the next train dataloader starts at."""

    def __init__(self) -> None:
        super().__init__()
        self.start = 0

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Batches(self.start, self.trainer.global_rank), batch_size=None)

    def state_dict(self) -> dict[str, Any]:
        return {"start": self.trainer.global_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.start = int(state_dict["start"])


class Net(LightningModule):
    def __init__(self, fault: str = "") -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
        self.kind, at, who = "", -1, -1
        if fault and os.environ.get("MEGASCALE_FT_ATTEMPT", "0") == "0":
            self.kind, where = fault.split("@")
            at, who = (int(v) for v in where.split(":"))
        self.at, self.who = at, who

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.global_rank == self.who and self.global_step == self.at:
            if self.kind == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.kind == "nan":
                loss = loss * float("nan")
            if self.kind == "sigterm":  # to the launcher (torchrun's parent), as a scheduler would send it
                with open(f"/proc/{os.getppid()}/stat") as f:
                    launcher = int(f.read().rsplit(")", 1)[1].split()[1])
                os.kill(launcher, signal.SIGTERM)
                stop = self.trainer.strategy._preemption  # MegaScaleStrategy's SIGTERM stop
                deadline = time.monotonic() + 60
                while not stop.requested and time.monotonic() < deadline:  # until the forwarded one arrives,
                    time.sleep(0.01)  # so the run stops after this very step (the test checks which)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--fault", default="", help="KIND@STEP:RANK, first attempt only")
    parser.add_argument("--strategy", choices=["ddp", "megascale"], default="ddp")
    args = parser.parse_args()
    torch.set_num_threads(1)
    seed_everything(0)
    model = Net(args.fault)  # the same initial weights on every rank
    torch.manual_seed(100 + int(os.environ.get("RANK", "0")))  # then a different dropout stream per rank
    ft = FaultTolerance(args.ckpt, every_n_steps=args.every, keep_last=2)
    if args.strategy == "megascale":
        from megascale.lightning import MegaScaleStrategy

        strategy: Any = MegaScaleStrategy(
            zero_stage=0, process_group_backend="gloo", timeout=ft.collective_timeout
        )
    else:
        strategy = DDPStrategy(process_group_backend="gloo", timeout=ft.collective_timeout)
    trainer = Trainer(
        accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", "1")), strategy=strategy,
        max_steps=args.steps, callbacks=[ft], use_distributed_sampler=False, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, datamodule=Data())
    if trainer.global_rank == 0:
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        torch.save(
            {"weights": weights, "restored_step": ft.restored_step, "end": trainer.global_step}, args.out
        )
    finish_and_exit()


if __name__ == "__main__":
    main()
