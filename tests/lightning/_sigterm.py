"""A callback for tests/lightning/test_preemption.py: sends SIGTERM to its own process as a step starts (the
handler runs at once, with the step's collectives all still to come) and records what the fit did.

    callbacks: [{class_path: tests.lightning._sigterm.SignalAt, init_args: {step: 3, ranks: [0]}}]   # YAML
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer


class SignalAt(Callback):
    """SIGTERM to this process at optimizer step ``step`` on the global ranks ``ranks``; rank 0 writes
    ``record`` (JSON): the step the fit started at, the step it signalled at, the step it ended at, and the
    seconds from the signal to the end of the fit."""

    def __init__(self, step: int, ranks: list[int], record: str = "sigterm.json") -> None:
        self.step, self.ranks, self.record = step, list(ranks), record
        self.start: int | None = None
        self.sent: float | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.start = trainer.global_step

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step and self.sent is None:
            self.sent = time.monotonic()
            if trainer.global_rank in self.ranks:
                os.kill(os.getpid(), signal.SIGTERM)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.global_rank == 0:
            seconds = None if self.sent is None else time.monotonic() - self.sent
            record = {
                "start": self.start,
                "signalled": self.step,
                "end": trainer.global_step,
                "seconds": seconds,
            }
            with open(self.record, "w") as f:
                json.dump(record, f)
