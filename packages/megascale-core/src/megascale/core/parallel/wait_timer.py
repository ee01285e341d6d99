"""Timing the waits of the parallel runtime, for straggler detection (megascale-ft) and timelines.

In synchronous training every rank's step lasts as long as the slowest rank's, so step times cannot name a
slow rank; the time each rank spends *waiting* for the others can: the slow rank computes long and waits
little, its peers the reverse. The runtime calls a ``WaitTimer`` around the points where it blocks on other
ranks, with the kind of wait: the data-parallel gradient reduction still outstanding after backward
(``"grad-reduce"``), ZeRO-1's parameter gathers waited for by the next forward (``"param-gather"``), the
decoupled pipeline schedules' receives and sends (``"pipeline-recv-F"``, ...), and the tensor-parallel
collectives of forward and backward (``"tp-all-gather"``, ``"tp-reduce-scatter"``, ``"tp-all-reduce"``). By
default nothing is timed; megascale-ft's ``FaultTolerance`` gives its step timer's sections (named
``wait/<kind>``).

The timer reaches the code that waits through the objects that own it (the ZeRO runtime, the pipeline and
its schedules, each tensor-parallel layer, which hands it to its autograd functions), never through a global:
two models in one process keep their own.

A ``Timers`` is a ``WaitTimer`` (called, it times a wait) that also times the pipeline schedules'
per-microbatch computations, for timelines that show every forward and backward of every stage:
``compute(kind, microbatch, stage)`` with kind ``"F"`` (forward, loss included on the last stage) or ``"B"``
(backward). Those are computations, not waits: a straggler is judged by step time minus waits, and these
sections must not be named like waits.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

__all__ = ["ComputeTimer", "Timers", "WaitTimed", "WaitTimer", "compute_timer", "untimed"]

WaitTimer = Callable[[str], AbstractContextManager[None]]
"""Called with the kind of wait; the context it returns spans the wait."""

ComputeTimer = Callable[[str, int, int], AbstractContextManager[None]]
"""Called with (kind "F" | "B", microbatch, stage) of a pipeline computation; the context spans it."""


class WaitTimed(Protocol):
    """An object that times its own waits with its ``wait_timer`` (a tensor-parallel layer)."""

    wait_timer: WaitTimer


def untimed(kind: str) -> AbstractContextManager[None]:
    """The default ``WaitTimer``: times nothing."""
    return nullcontext()


@dataclass(frozen=True)
class Timers:
    """A ``WaitTimer`` (``wait``) together with a ``ComputeTimer`` for the pipeline's microbatches.

    One object, so that it travels wherever a ``WaitTimer`` already does (the runtime's ``set_wait_timer``
    down to the schedules) and every holder of a wait timer keeps working unchanged.
    """

    wait: WaitTimer
    compute: ComputeTimer

    def __call__(self, kind: str) -> AbstractContextManager[None]:
        return self.wait(kind)


def compute_timer(timer: WaitTimer) -> ComputeTimer | None:
    """The ``ComputeTimer`` that travels with ``timer`` (a ``Timers``), or None: nothing to time."""
    return timer.compute if isinstance(timer, Timers) else None
