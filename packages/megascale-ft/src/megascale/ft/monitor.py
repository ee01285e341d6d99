"""The driver's judgement: from heartbeats and process liveness, is a rank dead, hung or anomalous?

Kept apart from the transport and the launcher so it can be tested with synthetic heartbeats and a clock.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from megascale.ft._procs import pid_alive
from megascale.ft.config import Timeouts
from megascale.ft.heartbeat import Heartbeat

__all__ = ["Fault", "JobMonitor", "pid_alive"]

MAX_EVENTS_PER_RANK = 20_000  # sections (a big model's TP waits: thousands per step), the newest kept
# a rank this many heartbeat intervals without a heartbeat has stopped beating (not merely a late one): a
# stall is blamed on it
QUIET_BEATS = 4
MAX_STEPS_PER_RANK = 5_000  # step events, kept apart: they carry their waits, for the straggler window


# what a rank's error says when a peer broke the collective it was in (gloo, NCCL, the store): a consequence
_PEER_ERRORS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "NCCL",
    "gloo/transport",
    "Broken pipe",
)


def _peer_error(message: str) -> bool:
    return any(marker in message for marker in _PEER_ERRORS)


def _progress_limit(r: _Rank, t: Timeouts) -> float:
    """How long a rank may go without progress: ``hang_timeout`` between steps; ``startup_timeout`` before
    its first step (loading, restoring) and after its last ("finishing": the final checkpoint's commit, a
    sample, teardown), where work of unknown length runs without steps."""
    return t.hang_timeout if r.first_step_done and r.beat.status != "finishing" else t.startup_timeout


@dataclass(frozen=True)
class Fault:
    """What went wrong, where, and when it was noticed.

    ``kind``: "dead" (process gone), "hung" (no heartbeat or no progress), "exception", "nan", or
    "exit" (the job ended with an error and no rank said why). ``since``: the last time the rank was
    seen healthy, so ``detected - since`` is the detection latency.
    """

    kind: str
    rank: int | None
    host: str
    message: str
    detected: float
    since: float
    #: a hang: every rank's stacks and the ranks that stand out (``megascale.ft.stacks.HangReport.to_json``)
    stacks: dict[str, Any] | None = None
    #: the node (agent name) the fault is attributed to, in multi-node launches
    node: str | None = None

    @property
    def latency(self) -> float:
        return max(0.0, self.detected - self.since)

    @property
    def signature(self) -> tuple[str, int | None, str]:
        """Equal signatures = the run failed the same way (numbers such as pids and seconds ignored)."""
        first = self.message.splitlines()[0][:200] if self.message else ""
        return self.kind, self.rank, re.sub(r"\d+(\.\d+)?", "#", first)

    def __str__(self) -> str:
        where = f"host {self.host}" if self.node is None else f"node {self.node}, host {self.host}"
        who = f"the job ({where})" if self.rank is None else f"rank {self.rank} ({where})"
        return f"{who}: {self.kind}: {self.message} (noticed {self.latency:.1f} s after its last heartbeat)"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "latency": self.latency}


@dataclass
class _Rank:
    beat: Heartbeat
    seen: float  # driver clock of the last heartbeat
    progressed: float  # driver clock of the last change of step or progress
    first_step_done: bool


class JobMonitor:
    """Tracks every rank of one attempt and reports the first fault it can attribute.

    Args:
        world_size: ranks expected to report.
        timeouts: the hierarchy of `Timeouts`.
        clock: time source (tests pass a fake one).
        gone: whether a rank's process is known to be gone; by default its pid is checked when it runs on
            this host. The multi-node driver asks the rank's node agent instead.
    """

    def __init__(
        self,
        world_size: int,
        timeouts: Timeouts,
        clock: Callable[[], float] = time.time,
        gone: Callable[[Heartbeat], bool] | None = None,
    ) -> None:
        self.world_size, self.timeouts, self.clock = world_size, timeouts, clock
        self._gone = gone or self._local_pid_gone
        self.started = clock()
        self.host = socket.gethostname()
        self._ranks: dict[int, _Rank] = {}
        self._anomaly: Fault | None = None
        self._lock = threading.Lock()
        self.events: dict[int, list[dict[str, Any]]] = {}  # sections
        self.steps: dict[int, list[dict[str, Any]]] = {}  # step events
        self.hosts: dict[int, str] = {}
        self.coords: dict[int, dict[str, int]] = {}

    def on_heartbeat(self, beat: Heartbeat) -> None:
        now = self.clock()
        with self._lock:
            prev = self._ranks.get(beat.rank)
            if prev is not None and prev.beat.pid == beat.pid and beat.sent and beat.sent < prev.beat.sent:
                return  # an older heartbeat overtaken by a newer one
            if prev is None or (beat.step, beat.progress) != (prev.beat.step, prev.beat.progress):
                progressed = now
            else:
                progressed = prev.progressed
            done = beat.step >= 0 or (prev is not None and prev.first_step_done)
            self._ranks[beat.rank] = _Rank(beat, now, progressed, done)
            self.hosts[beat.rank] = beat.host
            if beat.coords:
                self.coords[beat.rank] = dict(beat.coords)
                where = " ".join(f"{k}{v}" for k, v in sorted(beat.coords.items()))
                self.hosts[beat.rank] = f"{where}, {beat.host}"  # labels a timeline row
            if beat.events:
                for kept, bound, events in (
                    (self.steps.setdefault(beat.rank, []), MAX_STEPS_PER_RANK,
                     [e for e in beat.events if e.get("name") == "step"]),
                    (self.events.setdefault(beat.rank, []), MAX_EVENTS_PER_RANK,
                     [e for e in beat.events if e.get("name") != "step"]),
                ):  # fmt: skip
                    kept.extend(events)
                    del kept[:-bound]
            # the first anomaly is kept, unless it is a peer's broken collective and a rank now reports a
            # cause of its own (a data reader that died, a NaN): the broken collective is its consequence
            replace = self._anomaly is None or (
                _peer_error(self._anomaly.message) and not _peer_error(beat.message)
            )
            if beat.status in ("error", "nan") and replace:
                kind = "exception" if beat.status == "error" else "nan"
                since = prev.seen if prev is not None else self.started
                self._anomaly = Fault(kind, beat.rank, beat.host, beat.message, now, since, node=beat.node)

    def _local_pid_gone(self, beat: Heartbeat) -> bool:
        return beat.host == self.host and not pid_alive(beat.pid)

    def finished(self) -> bool:
        """Every rank reported status "finished"."""
        with self._lock:
            return len(self._ranks) == self.world_size and all(
                r.beat.status == "finished" for r in self._ranks.values()
            )

    def timings(self) -> dict[int, list[dict[str, Any]]]:
        """A copy of every rank's timing events so far (see `megascale.ft.timing`)."""
        with self._lock:
            ranks = self.steps.keys() | self.events.keys()
            return {r: [*self.steps.get(r, []), *self.events.get(r, [])] for r in ranks}

    @property
    def nodes(self) -> dict[int, str | None]:
        """Each rank's node name (multi-node runs; None under the one-node launcher)."""
        with self._lock:
            return {rank: r.beat.node for rank, r in self._ranks.items()}

    def last_steps(self) -> dict[int, int]:
        with self._lock:
            return {rank: r.beat.step for rank, r in self._ranks.items()}

    def check(self) -> Fault | None:
        """The first attributable fault now, or None.

        Order: processes gone without a word, reported anomalies, ranks without heartbeats, ranks without
        progress. Root causes first: a rank killed outright makes its peers' collectives fail a moment
        later, and they report that exception; a rank that waits in a collective for a stopped peer keeps
        beating but does not progress, so the silent one is named first.
        """
        now = self.clock()
        t = self.timeouts
        with self._lock:
            anomaly = self._anomaly
            ranks = dict(self._ranks)
        # one pass, no sort: the driver calls this 10 times a second, and at 10,000 nodes x 8 ranks the three
        # sorted passes (and a set of every rank after startup) took 0.36 s of CPU a call, 3.6 cores, against
        # 0.04 s for this one; each kind keeps its lowest rank, as the sorted passes named it (the order of
        # the kinds is the docstring's)
        gone: tuple[int, _Rank] | None = None
        silent: tuple[int, _Rank] | None = None
        stalled: tuple[int, _Rank] | None = None
        quiet: tuple[int, _Rank] | None = None  # the longest without a heartbeat (its beats have stopped)
        present = 0  # ranks of this world heard from: the missing ones are listed only when some are
        for rank, r in ranks.items():
            present += 0 <= rank < self.world_size
            if r.beat.status == "finished":
                continue
            alive = r.beat.status in ("running", "finishing")
            if alive and (gone is None or rank < gone[0]) and self._gone(r.beat):
                gone = rank, r
            if now - r.seen > t.hang_timeout and (silent is None or rank < silent[0]):
                silent = rank, r
            if now - r.seen > QUIET_BEATS * t.heartbeat_interval and (
                quiet is None or r.seen < quiet[1].seen
            ):
                quiet = rank, r
            limit = _progress_limit(r, t)
            if now - r.progressed > limit and (stalled is None or rank < stalled[0]):
                stalled = rank, r
        if gone is not None:
            rank, r = gone
            message = f"process {r.beat.pid} is gone"
            return Fault("dead", rank, r.beat.host, message, now, r.seen, node=r.beat.node)
        if anomaly is not None:
            return anomaly
        if silent is not None:
            rank, r = silent
            message = f"no heartbeat for {now - r.seen:.1f} s (hang_timeout {t.hang_timeout} s)"
            return Fault("hung", rank, r.beat.host, message, now, r.seen, node=r.beat.node)
        if now - self.started > t.startup_timeout and present < self.world_size:
            missing = sorted(set(range(self.world_size)) - set(ranks))
            if missing:
                message = f"never sent a heartbeat within startup_timeout {t.startup_timeout} s"
                return Fault("hung", missing[0], "?", message, now, self.started)
        if stalled is not None and quiet is not None:
            # the peers stalled first (their last step ended before the frozen rank's last heartbeat), but a
            # rank whose heartbeats stopped is what they wait for: its heartbeat thread runs apart from its
            # training, so only a frozen or vanished process falls quiet
            rank, r = quiet
            message = (f"no heartbeat for {now - r.seen:.1f} s while its peers' steps stalled (rank {stalled[0]} "
                       f"for {now - stalled[1].progressed:.1f} s): frozen, or cut off")  # fmt: skip
            return Fault("hung", rank, r.beat.host, message, now, r.seen, node=r.beat.node)
        if stalled is not None:
            rank, r = stalled
            limit = _progress_limit(r, t)
            message = f"step {r.beat.step} (progress {r.beat.progress}) has not advanced for {now - r.progressed:.1f} s (limit {limit} s)"
            return Fault("hung", rank, r.beat.host, message, now, r.progressed, node=r.beat.node)
        return None
