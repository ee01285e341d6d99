"""A tiny megascale GPT fitted with MegaScaleStrategy and `FaultTolerance`, under ``megascale-ft launch``.

    megascale-ft launch --nproc-per-node 2 -- tests/integration/_fit_megascale.py CKPT_DIR OUT.pt [--tp 2]
        [--pp 1] [--zero-stage 1] [--microbatches M] [--every 2] [--max-bytes 20000]
        [--fault sigkill@STEP:RANK | slow@STEP:RANK]

GPTModule (AdamW, warmup + cosine schedule, gradient clipping) on TokenDataModule (shuffled, resumable) with
dropout drawing from each rank's own generator. A fault fires in the first attempt only
(``MEGASCALE_FT_ATTEMPT=0``): ``sigkill`` kills rank RANK in training_step at optimizer step STEP.
Rank 0 writes OUT.pt: {"weights": the whole model (gathered from every tp shard and pipeline stage),
"restored_step": the step resumed from, "restores": every rank's `FaultTolerance.restore_stats` as a dict}.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer, seed_everything
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from megascale.core import GPTConfig
from megascale.core.config import MoEConfig
from megascale.ft.lightning import FaultTolerance
from megascale.lightning import GPTModule, MegaScaleStrategy, TokenDataModule
from tests._dist import finish_and_exit

CONFIG = GPTConfig(vocab_size=100, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32,
                   pad_vocab_to_multiple_of=64, dropout=0.1)  # fmt: skip


# --ep: the same GPT with every MLP a mixture of 4 experts (top 2, every balancing on), split over the ranks
MOE = MoEConfig(num_experts=4, top_k=2, expert_hidden=32, aux_loss_coef=0.01, bias_update_rate=1e-3)


class FaultyGPT(GPTModule):
    def __init__(self, fault: str, config: GPTConfig = CONFIG, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.kind, self.at, self.who = "", -1, -1
        if fault and os.environ.get("MEGASCALE_FT_ATTEMPT", "0") == "0":
            self.kind, where = fault.split("@")
            self.at, self.who = (int(v) for v in where.split(":"))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.kind == "sigkill" and self.global_rank == self.who and self.global_step == self.at:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "slow" and self.global_rank == self.who and self.global_step >= self.at:
            time.sleep(0.2)  # a slow host: this rank computes longer every step, its peers wait for it
        return super().training_step(batch, batch_idx)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--zero-stage", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1, help="expert parallelism (a mixture of experts GPT)")
    parser.add_argument("--microbatches", type=int, default=None, help="pipeline microbatches (default pp)")
    parser.add_argument("--every", type=int, default=2, help="checkpoint every this many steps")
    parser.add_argument("--max-bytes", type=int, default=20_000, help="tokens (210: 12 training windows)")
    parser.add_argument("--fault", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    seed_everything(0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = dataclasses.replace(CONFIG, moe=MOE) if args.ep > 1 else CONFIG
    model = FaultyGPT(args.fault, config, lr=1e-3, warmup_steps=2, decay_steps=20, init_seed=0)
    data = TokenDataModule(
        source="random:100", seq_len=16, batch_size=4, max_bytes=args.max_bytes, shuffle=True
    )
    torch.manual_seed(100 + int(os.environ.get("RANK", "0")))  # a different dropout stream per rank
    ft = FaultTolerance(args.ckpt, every_n_steps=args.every, keep_last=2)
    strategy = MegaScaleStrategy(
        tp=args.tp, pp=args.pp, ep=args.ep, zero_stage=args.zero_stage, num_microbatches=args.microbatches,
        timeout=ft.collective_timeout,
    )  # fmt: skip
    trainer = Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=args.steps, callbacks=[ft],
        gradient_clip_val=0.5, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    # this stage's whole layers on every rank (a collective over the tensor-parallel shards), then all stages
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    restore = None if ft.restore_stats is None else dataclasses.asdict(ft.restore_stats)
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, ({k: v.detach().clone() for k, v in full.items()}, restore))
    if trainer.global_rank == 0:
        weights = {k: v for stage, _ in parts for k, v in stage.items()}
        restores = [r for _, r in parts]
        torch.save({"weights": weights, "restored_step": ft.restored_step, "restores": restores}, args.out)
    finish_and_exit()


if __name__ == "__main__":
    main()
