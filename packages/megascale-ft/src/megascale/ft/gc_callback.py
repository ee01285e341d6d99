"""`SynchronizedGC`: the synchronised garbage collection of ``sync_gc.py`` as a Lightning callback."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback

from megascale.ft.sync_gc import GCSchedule

__all__ = ["SynchronizedGC"]


class SynchronizedGC(Callback):
    """Lightning callback running `GCSchedule` on every rank: automatic GC off from the start of fit, a
    collection after every ``every_n_steps``-th optimizer step (``trainer.global_step``, equal on all ranks),
    the collector restored at the end (also when fit fails).

    Args:
        every_n_steps: optimizer steps between collections.
        generation: the generation collected (2: a full collection, as MegaScale does).
    """

    def __init__(self, every_n_steps: int = 100, generation: int = 2) -> None:
        super().__init__()
        self.schedule = GCSchedule(every_n_steps, generation)
        self._last = -1

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.schedule.start()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = int(trainer.global_step)
        if step != self._last:  # gradient accumulation: several batches end at one optimizer step
            self._last = step
            self.schedule.step(step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.schedule.stop()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.schedule.stop()
