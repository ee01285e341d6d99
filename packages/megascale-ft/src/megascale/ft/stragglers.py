"""Finding straggler ranks from the step and section timings the ranks send (see `megascale.ft.timing`).

Scope: pure functions on event dicts ``{"name", "step", "start", "dur"}``; no transport, no torch.

Why compute time rather than step time: in synchronous data-parallel training every step ends with
collectives (gradient all-reduce, FSDP gathers), so each rank's *step* takes as long as the slowest rank's:
the fast ranks simply wait inside the collective. Whole-step times are therefore (nearly) equal on every
rank and cannot say who is slow. What differs is how the step splits: the slow rank computes for long and
waits little, the others compute briefly and wait long. So a rank is judged by its **compute time**: step
duration minus the time spent in *wait* sections (by default names starting with ``"wait"``, or exactly
``"allreduce"``, ``"collective"`` or ``"data"``; pass ``waits=`` to change that). Waiting for the data
loader counts as waiting by default, so a rank held up by its own loader is not reported as computing
slowly; its long ``"data"`` sections show in the timeline (pass ``waits=`` without ``"data"`` to flag it).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["StepTiming", "Straggler", "find_stragglers", "is_wait", "step_timings"]

Event = Mapping[str, Any]
WaitPredicate = Callable[[str], bool]

_WAIT_NAMES = frozenset({"allreduce", "collective", "data"})


def is_wait(name: str) -> bool:
    """The default wait predicate: ``name`` starts with ``"wait"`` or is ``"allreduce"``,
    ``"collective"`` or ``"data"`` (case-insensitive)."""
    lowered = name.lower()
    return lowered.startswith("wait") or lowered in _WAIT_NAMES


@dataclass(frozen=True)
class StepTiming:
    """One finished step of one rank."""

    step: int
    start: float  # unix seconds
    dur: float  # whole step, seconds
    wait: float  # seconds inside wait sections (overlaps counted once)

    @property
    def compute(self) -> float:
        """Step time not spent waiting, in seconds."""
        return max(self.dur - self.wait, 0.0)


@dataclass
class Straggler:
    """A rank whose median compute time (step minus waits) exceeds the threshold × the median over ranks.

    ``median_step`` and ``rank_step`` are those compute times in seconds; ``steps`` how many steps of the
    rank were looked at.
    """

    rank: int
    host: str
    median_step: float
    rank_step: float
    ratio: float
    steps: int

    def __str__(self) -> str:
        host = f" (host {self.host})" if self.host else ""
        return (
            f"rank {self.rank}{host} is {self.ratio:.2f}x slower than the median step "
            f"({self.rank_step:.3f} s vs {self.median_step:.3f} s over {self.steps} steps)"
        )


def step_timings(events: Sequence[Event], *, waits: WaitPredicate | None = None) -> list[StepTiming]:
    """One rank's finished steps in start order, each with the time it spent in wait sections.

    A wait section counts for the step with the same step number, clipped to that step's interval. A step
    event that carries its own ``"wait"`` (`megascale.ft.timing.StepTimer` sums them on the rank, so they
    survive when the driver keeps fewer events than a step has) is taken as it is, unless ``waits`` is given.
    """
    summed = waits is None
    waits = waits or is_wait
    steps: list[StepTiming] = []
    given: dict[tuple[int, float], float] = {}
    waiting: dict[int, list[tuple[float, float]]] = {}
    for event in events:
        name, step, start, dur = _fields(event)
        if name == "step":
            steps.append(StepTiming(step, start, dur, 0.0))
            if summed and event.get("wait") is not None:
                given[(step, start)] = float(event["wait"])
        elif waits(name):
            waiting.setdefault(step, []).append((start, start + dur))
    steps.sort(key=lambda s: s.start)

    def wait(s: StepTiming) -> float:
        if (s.step, s.start) in given:
            return given[(s.step, s.start)]
        return _covered(waiting.get(s.step, []), s.start, s.start + s.dur)

    return [StepTiming(s.step, s.start, s.dur, wait(s)) for s in steps]


def find_stragglers(
    events: Mapping[int, Sequence[Event]],
    *,
    threshold: float = 1.2,
    hosts: Mapping[int, str] | None = None,
    window: int = 20,
    min_steps: int = 3,
    waits: WaitPredicate | None = None,
) -> list[Straggler]:
    """Flag the ranks that compute slower than the others.

    Args:
        events: each rank's timing events (as `megascale.ft.timing.StepTimer.drain` returns them).
        threshold: flag a rank whose median compute time exceeds ``threshold`` × the median over ranks.
        hosts: host name of each rank, for the messages.
        window: look at each rank's last ``window`` steps.
        min_steps: ignore ranks with fewer finished steps than this.
        waits: which section names are waiting rather than computing (default `is_wait`).

    Returns:
        The stragglers, slowest first. Compute time is step time minus waits: see the module docstring
        for why whole-step times cannot reveal a straggler in synchronous training. With two ranks the
        median is their mean, so a rank can be at most 2x "slower than the median".
    """
    if threshold <= 0 or window < 1 or min_steps < 1:
        raise ValueError(
            f"need threshold > 0, window >= 1, min_steps >= 1; got {threshold}, {window}, {min_steps}"
        )
    hosts = hosts or {}
    per_rank: dict[int, tuple[float, int]] = {}
    for rank, rank_events in events.items():
        recent = step_timings(rank_events, waits=waits)[-window:]
        if len(recent) >= min_steps:
            per_rank[rank] = (statistics.median(t.compute for t in recent), len(recent))
    if not per_rank:
        return []
    median = statistics.median(value for value, _ in per_rank.values())
    if median <= 0:  # every rank only waited: no meaningful ratio
        return []
    found = [
        Straggler(rank, hosts.get(rank, ""), median, value, value / median, n)
        for rank, (value, n) in per_rank.items()
        if value > threshold * median
    ]
    return sorted(found, key=lambda s: (-s.ratio, s.rank))


def _fields(event: Event) -> tuple[str, int, float, float]:
    try:
        return str(event["name"]), int(event["step"]), float(event["start"]), float(event["dur"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(
            f"malformed timing event {event!r}: expected name, step, start and dur ({err})"
        ) from err


def _covered(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``intervals`` within ``[lo, hi]`` (nested waits are counted once)."""
    total, reached = 0.0, lo
    for start, end in sorted(intervals):
        start, end = max(start, reached), min(end, hi)
        if end > start:
            total += end - start
            reached = end
    return total
