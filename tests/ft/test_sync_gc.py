"""Synchronised garbage collection: no automatic collection during training, one at each scheduled step,
the collector restored after (also inside a Lightning fit)."""

from __future__ import annotations

import gc
from typing import Any

import pytest

from megascale.ft import GCSchedule


class _Cycle:
    def __init__(self) -> None:
        self.me = self  # garbage only the cyclic collector frees


def _full_collections() -> tuple[list[int], Any]:
    seen: list[int] = []

    def record(phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and info["generation"] == 2:
            seen.append(1)

    gc.callbacks.append(record)
    return seen, record


def test_the_schedule_collects_only_at_its_steps_and_restores_the_collector() -> None:
    assert gc.isenabled()
    seen, record = _full_collections()
    try:
        schedule = GCSchedule(every_n_steps=5)
        schedule.start()
        seen.clear()  # start() collects once
        assert not gc.isenabled()
        for step in range(1, 13):
            for _ in range(3000):  # well past the thresholds: automatic GC would have run many times
                _Cycle()
            schedule.step(step)
        assert len(seen) == 2 and len(schedule.pauses) == 2  # steps 5 and 10, nothing in between
        schedule.stop()
        assert gc.isenabled()
        gc.disable()  # a collector the user had turned off stays off
        schedule.start()
        schedule.stop()
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.callbacks.remove(record)
    with pytest.raises(ValueError, match="every_n_steps"):
        GCSchedule(every_n_steps=0)


def test_synchronized_gc_in_a_lightning_fit(tmp_path) -> None:
    import torch
    from lightning.pytorch import LightningModule, Trainer

    from megascale.ft import SynchronizedGC

    class Tiny(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            for _ in range(2000):
                _Cycle()
            return self.layer(batch).sum()

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(torch.randn(64, 4), batch_size=4)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    callback = SynchronizedGC(every_n_steps=3)
    trainer = Trainer(max_steps=7, accumulate_grad_batches=2, callbacks=[callback], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=tmp_path)  # fmt: skip
    seen, record = _full_collections()
    try:
        trainer.fit(Tiny())
    finally:
        gc.callbacks.remove(record)
    assert len(callback.schedule.pauses) == 2  # optimizer steps 3 and 6, once each despite accumulation
    # 28 batches of 2000 cycles each and no automatic collection: the one at the start and the two scheduled
    assert len(seen) == 3, len(seen)
    assert gc.isenabled()
