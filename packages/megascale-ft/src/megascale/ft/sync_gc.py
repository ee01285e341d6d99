"""Synchronised garbage collection: Python's automatic collector off during training, one collection at the
same step on every rank every ``every_n_steps`` (MegaScale §4, a fix for MFU decaying over a run).

Why: CPython's cyclic collector runs whenever allocations cross its thresholds, which happens at a different
moment on every rank; a full collection of a large training process takes tens to hundreds of milliseconds,
and in synchronous training every other rank waits for it at the next collective. With N ranks collecting
independently, some rank is collecting in most steps. Collecting everywhere at the same step turns N
unaligned pauses into one aligned pause every ``every_n_steps``.

Reference counting still frees everything that is not in a cycle; only cyclic garbage waits for the next
scheduled collection. The collector's state (enabled or not) is restored when training ends. `SynchronizedGC`
(``megascale.ft.gc_callback``) runs it in a Lightning ``Trainer``.
"""

from __future__ import annotations

import gc
import time

__all__ = ["GCSchedule"]


class GCSchedule:
    """The schedule itself, for any training loop: ``start()``, ``step(n)`` after each optimizer step,
    ``stop()``. ``pauses`` records the seconds each scheduled collection took."""

    def __init__(self, every_n_steps: int = 100, generation: int = 2) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps} must be >= 1")
        if generation not in (0, 1, 2):
            raise ValueError(f"generation={generation} must be 0, 1 or 2")
        self.every_n_steps, self.generation = every_n_steps, generation
        self.pauses: list[float] = []
        self._was_enabled: bool | None = None

    def start(self) -> None:
        """Turn automatic collection off (collecting once first, so training starts from a clean heap)."""
        if self._was_enabled is None:
            self._was_enabled = gc.isenabled()
        gc.collect()
        gc.disable()

    def step(self, step: int) -> None:
        """After optimizer step ``step`` (1-based count of steps taken): collect when it is a multiple."""
        if self._was_enabled is not None and step > 0 and step % self.every_n_steps == 0:
            started = time.perf_counter()
            gc.collect(self.generation)
            self.pauses.append(time.perf_counter() - started)

    def stop(self) -> None:
        """Give the collector back as it was."""
        if self._was_enabled is not None:
            if self._was_enabled:
                gc.enable()
            self._was_enabled = None
