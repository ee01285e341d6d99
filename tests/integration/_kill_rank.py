"""A callback for the main-job test: SIGKILL one rank at one optimizer step, in the first attempt only."""

from __future__ import annotations

import os
import signal
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer


class KillRank(Callback):
    """Kill global rank ``rank`` as optimizer step ``step`` starts, when ``MEGASCALE_FT_ATTEMPT`` is 0."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, idx: int
    ) -> None:
        first_attempt = os.environ.get("MEGASCALE_FT_ATTEMPT", "0") == "0"
        if first_attempt and trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
