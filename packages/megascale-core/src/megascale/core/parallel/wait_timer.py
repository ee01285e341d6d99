"""Timing the waits of the parallel runtime, for straggler detection (megascale-ft) and timelines.

In synchronous training every rank's step lasts as long as the slowest rank's, so step times cannot name a
slow rank; the time each rank spends *waiting* for the others can: the slow rank computes long and waits
little, its peers the reverse. The runtime calls a ``WaitTimer`` around the points where it blocks on other
ranks — the data-parallel gradient reduction still outstanding after backward, and ZeRO-1's parameter gathers
waited for by the next forward — with the kind of wait (``"grad-reduce"``, ``"param-gather"``). By default
nothing is timed; megascale-ft's ``FaultTolerance`` gives its step timer's sections (named ``wait/<kind>``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

__all__ = ["WaitTimer", "untimed"]

WaitTimer = Callable[[str], AbstractContextManager[None]]
"""Called with the kind of wait; the context it returns spans the wait."""


def untimed(kind: str) -> AbstractContextManager[None]:
    """The default ``WaitTimer``: times nothing."""
    return nullcontext()
