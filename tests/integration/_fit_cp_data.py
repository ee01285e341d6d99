"""Fits of a tiny GPT under MegaScaleStrategy(cp=2) on megascale's data modules, run by
tests/integration/test_context_parallel_data.py on forked ranks (tests/lightning/_launch.run_ranks).

    main(SHARDS, OUT, STEPS, CP)

For each data module (megascale-data's WebDataModule on SHARDS, megascale-lightning's TokenDataModule on
random bytes) two fits in this launch: an uninterrupted one of STEPS steps saving a checkpoint every STEPS/2
steps, and one resumed from its middle checkpoint to STEPS. Each rank writes, per module and fit, every
training batch it saw (global step and token rows) to OUT.rank<r>.json, and its dp and cp coordinates.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from megascale.core import GPTConfig
from megascale.data import Source, WebDataConfig, WebDataModule
from megascale.lightning import GPTModule, MegaScaleStrategy, TokenDataModule

SEQ, BATCH = 8, 2  # 8 tokens: two chunks of 2 per cp rank at cp=2


class _Record(Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[int, list[list[int]]]] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append((trainer.global_step, batch[0].tolist()))


def _data(kind: str, shards: str) -> Any:
    if kind == "web":
        config = WebDataConfig(
            sources=[Source(shards)], seq_len=SEQ, batch_size=BATCH, lanes=4, num_workers=0
        )
        return WebDataModule(config)
    return TokenDataModule(source="random:50", seq_len=SEQ, batch_size=BATCH, max_bytes=64 * SEQ + 1,
                           val_fraction=0.0)  # fmt: skip


def _fit(kind: str, shards: str, work: Path, steps: int, cp: int, resume: Path | None) -> list:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=257, d_model=16, n_layers=1, n_heads=2, max_seq_len=SEQ)
    record = _Record()
    trainer = Trainer(
        accelerator="cpu", devices=4, strategy=MegaScaleStrategy(cp=cp, zero_stage=1), max_steps=steps,
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, default_root_dir=work, enable_checkpointing=resume is None,
        callbacks=[record] + ([] if resume else [ModelCheckpoint(dirpath=work / "ckpt", every_n_train_steps=steps // 2,
                                                                   save_top_k=-1)]),
    )  # fmt: skip
    data = _data(kind, shards)
    trainer.fit(GPTModule(config, lr=3e-3, init_seed=0), datamodule=data, ckpt_path=resume)
    if hasattr(data, "teardown"):
        data.teardown("fit")
    return record.seen


def main(shards: str, out: str, steps: str, cp: str) -> None:
    torch.set_num_threads(1)
    n, size = int(steps), int(cp)
    work = Path(out).parent / "work"
    result: dict[str, Any] = {}
    for kind in ("web", "token"):
        whole = _fit(kind, shards, work / kind, n, size, None)
        middle = work / kind / "ckpt" / f"epoch=0-step={n // 2}.ckpt"
        resumed = _fit(kind, shards, work / f"{kind}-resumed", n, size, middle)
        result[kind] = {"whole": whole, "resumed": resumed}
    import torch.distributed as dist

    rank = dist.get_rank()
    result["dp"], result["cp"] = rank // size, rank % size  # ("dp", "pp", "cp", "tp"): cp inside dp here
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(result))
