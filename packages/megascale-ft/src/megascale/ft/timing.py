"""Per-rank step and section timings: what each rank sends to the driver with its heartbeats.

Scope: `StepTimer` only. It measures; it does not send anything (the heartbeat does, with `drain`) and
does not judge (see `megascale.ft.stragglers`).

Design choices:

- **CPU**: an event's start is ``time.time()`` (comparable across NTP-synchronized hosts, so the driver can
  line ranks up on one timeline) and its duration a ``time.perf_counter()`` delta (monotonic, fine-grained).
- **GPU**: a section's begin and end record CUDA events on the current stream, so timing measures the GPU
  work and never makes the host wait inside a step. The events are resolved lazily, in `drain`, which
  synchronizes each end event (it waits only for work already enqueued). Start times are tied to the wall
  clock by one anchor event, recorded and synchronized once when the timer is created (outside any step);
  create the timer after ``torch.cuda.set_device``. torch is imported only to find and use CUDA.
- **Bounded memory**: at most ``max_events`` finished events are kept between drains; the oldest are
  dropped first and counted in `StepTimer.dropped`, so a driver that stops draining cannot exhaust memory.
- `drain` may run on another thread (the heartbeat's) while the training thread records.
- **Per-step waits**: each drained step event carries ``"wait"``, the seconds of the outermost wait sections
  (``megascale.ft.stragglers.is_wait`` names) begun inside it. A large model times thousands of short waits
  per step (tensor-parallel collectives); the driver keeps only so many events per rank, but keeps the steps
  apart, so straggler detection never loses the waits of the steps it looks at.
- **Pipeline microbatches**: a pipeline stage's forward or backward of one microbatch is a section named
  `microbatch_section` (``"pipeline/F3@s1"``: forward of microbatch 3 on stage 1); events stay
  ``{"name", "step", "start", "dur"}`` and `parse_microbatch_section` reads the fields back (the timeline
  draws them as bars per microbatch). They are computations: no wait name.
"""

from __future__ import annotations

import itertools
import re
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

from megascale.ft.stragglers import is_wait

__all__ = ["MicrobatchSection", "StepTimer", "microbatch_section", "parse_microbatch_section"]

STEP = "step"  # the event name of a whole step; sections may use any other name
_MICROBATCH = re.compile(r"pipeline/([A-Z])(\d+)@s(\d+)")


class MicrobatchSection(NamedTuple):
    """What a pipeline microbatch section's name says."""

    kind: str  # "F" forward (the loss included on the last stage), "B" backward
    microbatch: int
    stage: int


def microbatch_section(kind: str, microbatch: int, stage: int) -> str:
    """The section name of a pipeline stage's computation on one microbatch: ``"pipeline/F3@s1"``."""
    return f"pipeline/{kind}{microbatch}@s{stage}"


def parse_microbatch_section(name: str) -> MicrobatchSection | None:
    """The fields of a `microbatch_section` name; None for any other name."""
    m = _MICROBATCH.fullmatch(name)
    return None if m is None else MicrobatchSection(m[1], int(m[2]), int(m[3]))


@dataclass
class _Record:
    seq: int  # begin order, which is start order
    name: str
    step: int
    outer_wait: bool = False  # a wait section begun inside a step, not nested in another wait
    start: float = 0.0  # unix seconds; on GPU filled in when resolved
    dur: float | None = None  # seconds; None until resolved (GPU) or finished (CPU)
    t0: float = 0.0  # perf_counter() at begin (CPU)
    begin_ev: Any = None  # torch.cuda.Event (GPU)
    end_ev: Any = None


class StepTimer:
    """Time training steps and the sections inside them, on one rank.

    Args:
        rank: this process's global rank (for the caller's bookkeeping; events do not repeat it).
        use_cuda: time GPU work with CUDA events; ``None`` uses them when ``torch.cuda.is_available()``.
        max_events: finished events kept until the next `drain`; older ones are dropped and counted.

    Example::

        timer = StepTimer(rank)
        for step, batch in enumerate(loader):
            with timer.step(step):
                with timer.section("forward"):
                    loss = model(batch)
                with timer.section("backward"):
                    loss.backward()
                with timer.section("optimizer"):
                    opt.step()
        heartbeat.send(timer.drain())

    Name waits on other ranks ``"wait..."`` (or ``"allreduce"``, ``"collective"``, ``"data"``) so that
    `megascale.ft.stragglers.find_stragglers` can tell compute from waiting.
    """

    def __init__(self, rank: int = 0, use_cuda: bool | None = None, max_events: int = 10_000) -> None:
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        self.rank = rank
        self.max_events = max_events
        self.dropped = 0  # finished events dropped because max_events was reached
        self._cuda: Any = None
        if use_cuda is None or use_cuda:
            self._cuda = _cuda_module(required=bool(use_cuda))
        self._anchor: Any = None
        self._anchor_wall = 0.0
        if self._cuda is not None:
            # The one synchronization of this timer: tie GPU event times to the wall clock.
            self._cuda.synchronize()
            self._anchor = self._cuda.Event(enable_timing=True)
            self._anchor.record()
            self._anchor.synchronize()
            self._anchor_wall = time.time()
        self._seq = itertools.count()
        self._done: deque[_Record] = deque()
        self._lock = threading.Lock()
        self._step = -1  # the current step, or the last one started
        self._in_step = False
        self._last_step: _Record | None = None
        self._last_step_time: float | None = None
        self._open_waits = 0  # wait sections open now (only the outermost counts toward its step)
        self._waits: dict[int, float] = {}  # step -> seconds of its outermost waits drained so far

    @property
    def use_cuda(self) -> bool:
        """Whether events are timed with CUDA events."""
        return self._cuda is not None

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Time one training step (an event named ``"step"``). Steps do not nest."""
        if self._in_step:
            raise RuntimeError(f"StepTimer.step({step}) inside step {self._step}: steps do not nest")
        self._step = step
        self._in_step = True
        try:
            with self._timed(STEP) as rec:
                yield
        finally:
            self._in_step = False
        self._last_step = rec

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Time a part of a step (``"forward"``, ``"wait_allreduce"``, ...). Sections nest; outside a
        step they are attributed to the last step started (-1 before the first)."""
        if name == STEP:
            raise ValueError(f"section name {STEP!r} is reserved for StepTimer.step()")
        waiting = is_wait(name)
        with self._timed(name) as rec:
            rec.outer_wait = waiting and self._in_step and self._open_waits == 0
            self._open_waits += waiting
            try:
                yield
            finally:
                self._open_waits -= waiting

    def record(self, name: str, step: int, start: float, dur: float) -> None:
        """Add an interval measured on the host clock (``start`` unix seconds, ``dur`` seconds) as a finished
        event of ``step``: work between steps that no context spans, such as fetching the next batch."""
        if name == STEP:
            raise ValueError(f"{STEP!r} events come from StepTimer.step()")
        rec = _Record(seq=next(self._seq), name=name, step=step, start=start, dur=max(dur, 0.0))
        rec.outer_wait = is_wait(name) and self._in_step and step == self._step and self._open_waits == 0
        with self._lock:
            self._done.append(rec)
            if len(self._done) > self.max_events:
                self._done.popleft()
                self.dropped += 1

    def drain(self) -> list[dict[str, Any]]:
        """Return and forget the finished events, in start order.

        Each is ``{"name": str, "step": int, "start": float (unix s), "dur": float (s)}``; a step's also has
        ``"wait"`` (s, see the module docstring). Events still
        open (the current step) stay for a later drain. On GPU this waits for the drained events' GPU work.
        """
        with self._lock:
            records = list(self._done)
            self._done.clear()
        records.sort(key=lambda r: r.seq)
        for rec in records:
            self._resolve(rec)
        for rec in records:  # a step's wait sections end before it does: drained with it or earlier
            if rec.outer_wait:
                self._waits[rec.step] = self._waits.get(rec.step, 0.0) + float(rec.dur or 0.0)
        events: list[dict[str, Any]] = []
        for r in records:
            event: dict[str, Any] = {"name": r.name, "step": r.step, "start": r.start, "dur": r.dur}
            if r.name == STEP:
                event["wait"] = min(self._waits.pop(r.step, 0.0), float(r.dur or 0.0))
                for old in [s for s in self._waits if s < r.step]:  # waits of steps never finished
                    del self._waits[old]
            events.append(event)
        return events

    @property
    def last_step_time(self) -> float | None:
        """Duration in seconds of the last finished step, ``None`` before the first.

        On GPU it never waits: it is the last step whose GPU work has completed (it may lag a step).
        """
        rec = self._last_step
        if rec is not None:
            end = rec.end_ev  # read once: a concurrent drain may resolve the record and release it
            if rec.dur is None and end is not None and end.query():
                self._resolve(rec)
            if rec.dur is not None:
                self._last_step_time = rec.dur
        return self._last_step_time

    # --- internals ----------------------------------------------------------------------------------------
    @contextmanager
    def _timed(self, name: str) -> Iterator[_Record]:
        rec = _Record(seq=next(self._seq), name=name, step=self._step)
        if self._cuda is not None:
            rec.begin_ev = self._cuda.Event(enable_timing=True)
            rec.end_ev = self._cuda.Event(enable_timing=True)
            rec.begin_ev.record()
        else:
            rec.start = time.time()
            rec.t0 = time.perf_counter()
        try:
            yield rec
        finally:  # a step that raised still took time; record it
            if self._cuda is not None:
                rec.end_ev.record()
            else:
                rec.dur = time.perf_counter() - rec.t0
            with self._lock:
                self._done.append(rec)
                if len(self._done) > self.max_events:
                    self._done.popleft()
                    self.dropped += 1

    def _resolve(self, rec: _Record) -> None:
        """Turn a record's CUDA events into start/duration (no-op on CPU or when already resolved)."""
        begin, end = rec.begin_ev, rec.end_ev
        if rec.dur is not None or begin is None:
            return
        end.synchronize()
        rec.start = self._anchor_wall + self._anchor.elapsed_time(begin) / 1e3
        rec.dur = begin.elapsed_time(end) / 1e3
        rec.begin_ev = rec.end_ev = None  # release the events


def _cuda_module(required: bool) -> Any:
    """``torch.cuda`` when CUDA is available, else None (or an error when ``required``)."""
    try:
        import torch  # lazily: only the GPU path needs torch
    except ImportError:
        if required:
            raise
        return None
    if torch.cuda.is_available():
        return torch.cuda
    if required:
        raise RuntimeError("StepTimer(use_cuda=True) but CUDA is not available")
    return None
