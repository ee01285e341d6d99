"""megascale-ft with 64 nodes on one machine: 64 simulated node agents x 8 ranks (threads speaking the real, signed
protocol; tests/ft/_sim_agents.py) against a real `ClusterDriver` in its own process (the slow test's nodes also
meet at its rendezvous store). No request may be refused, no fault declared but the one caused, and the rank
that goes silent must be named within its bound. benchmarks/ft_scale.py measures the same harness as N grows.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time

import pytest

from megascale.ft import heartbeat
from megascale.ft.heartbeat import Heartbeat, HeartbeatSender
from tests.ft._sim_agents import TOKEN, run_scenario

NODES, NPROC = 64, 8
# The driver notices a fault on its 0.1-s loop: past hang_timeout it was late by at most 0.26 s in every
# benchmark run (4 to 64 nodes over TLS, load average 3 to 48 on a shared 2-core machine; benchmarks/
# RESULTS.md). 3 s is >10x that, so only a driver that stalls (a loop blocked by its request threads, a
# scan that grew with N) fails, while it stays well below a second hang_timeout.
SLACK = 3.0


def _assert_healthy(result: dict) -> None:
    """Every request accepted (the server's own counts), no failure at the nodes' end but a request that took
    longer than its timeout (a busy machine: the senders retry), and no fault but the ones caused."""
    assert result["refused"] == 0 and result["turned_away"] == 0, result
    failures = result["beat_failures"] + result["agent_failures"]
    assert failures == result["timeouts"], result["errors"]
    assert result["false_faults"] == 0, result["attempts"]


def _assert_named_in_time(result: dict, kind: str, hang_timeout: float) -> None:
    # after the fault: at most hang_timeout (its last sign of life came before) plus the slack
    assert result[f"{kind}_detect_s"] <= hang_timeout + SLACK, result
    assert result[f"{kind}_overshoot_s"] <= SLACK, result


def test_64_agents_keep_beating_and_a_frozen_rank_is_named_within_its_bound(tmp_path):
    """Plain HTTP on loopback, heartbeats every 2.5 s (twice production's rate, so a few seconds see every
    rank several times) and the agents' production 0.25-s reports: ~460 requests/s, about 1.5 of the 2 cores
    with the simulated nodes' own share. TLS, production intervals and a lost node: the slow test below."""
    # 4 intervals (production: 12), as in the benchmark's sweep without a false fault: at 2, the hierarchy's
    # least, a machine at load average 20+ (this shared one) delayed the simulated ranks' own beats past it,
    # a false hang that says nothing of the driver
    hang_timeout = 10.0
    # ranks by node index, no rendezvous store (the slow test below meets at the store): 64 store clients
    # made in one process's threads take ~5 s of this test's 30
    result = run_scenario(
        NODES, tmp_path, nproc=NPROC, interval=2.5, hang_timeout=hang_timeout, window=1.5, faults=("hang",),
        rendezvous="none",
    )  # fmt: skip
    _assert_healthy(result)
    assert result["beats_per_s"] > 0.5 * NODES * NPROC / 2.5, result  # every rank was beating meanwhile
    assert result["attempts"][0]["kind"] == "hung", result["attempts"]
    _assert_named_in_time(result, "hang", hang_timeout)


@pytest.mark.slow  # ~2 min: a TLS handshake per request, both faults, production intervals
def test_64_agents_over_tls_at_production_intervals_name_a_hang_and_a_lost_node(tmp_path):
    from tests.ft.test_heartbeat import _self_signed

    hang_timeout = 20.0  # 4 intervals (see the fast test); production's 60 s only waits longer
    result = run_scenario(
        NODES, tmp_path, nproc=NPROC, interval=5.0, hang_timeout=hang_timeout, window=5.0,
        tls=_self_signed(tmp_path),
    )  # fmt: skip
    _assert_healthy(result)
    _assert_named_in_time(result, "hang", hang_timeout)
    _assert_named_in_time(result, "node", hang_timeout)


def _recording_post(monkeypatch, outcomes: dict[int, list[bool]] | None = None) -> list[tuple[int, float]]:
    """Replace `post` with a recorder: (rank, time) of every attempt; ``outcomes[rank]`` says, in turn, which
    attempts are accepted (then every further one is)."""
    sent: list[tuple[int, float]] = []
    lock = threading.Lock()

    def post(url: str, token: str, beat: Heartbeat, timeout: float, cafile: str | None = None) -> None:
        with lock:
            sent.append((beat.rank, time.monotonic()))
            plan = (outcomes or {}).get(beat.rank, [])
            if plan and not plan.pop(0):
                raise OSError("turned away")

    monkeypatch.setattr(heartbeat, "post", post)
    return sent


def test_senders_started_together_spread_their_beats_over_the_interval(monkeypatch):
    """Every rank starts its sender at about the same moment after a restart: the first periodic beats must not
    all come one interval later (a burst of every rank's connections, which the server's cap turns away at a
    few thousand ranks), but spread over the interval."""
    sent = _recording_post(monkeypatch)
    interval, count = 1.0, 40
    senders = [HeartbeatSender("http://127.0.0.1:1", TOKEN, interval, functools.partial(Heartbeat, rank=r))
               for r in range(count)]  # fmt: skip
    started = time.monotonic()
    for sender in senders:
        sender.start()
    time.sleep(interval + 0.2)
    for sender in senders:
        sender.stop()
    first = {rank: at - started for rank, at in reversed(sent)}  # each rank's first beat
    assert len(first) == count
    # uniform over the interval: ~half in its first half (fewer than 5 of 40 by chance: p ~ 1e-6); beats in
    # step would all come at 1 interval or later (a wait never ends early, a loaded machine only delays it)
    early = sum(at < interval / 2 for at in first.values())
    assert early >= 5, sorted(first.values())


def test_a_beat_turned_away_is_retried_soon_once_then_at_the_interval(monkeypatch):
    """A beat refused after accepted ones (a burst at the cap) is retried within a fifth of the interval, not
    an interval later; refused again, the sender keeps to the interval (no retry storm at a driver that is
    down or restarting)."""
    # deterministic (the sender's jitter has a generator of its own)
    monkeypatch.setattr(heartbeat.random.Random, "uniform", lambda self, low, high: (low + high) / 2)
    sent = _recording_post(monkeypatch, {0: [True, False, False, True]})
    interval = 2.0
    sender = HeartbeatSender("http://127.0.0.1:1", TOKEN, interval, lambda: Heartbeat(rank=0))
    sender.start()
    # accepted (0.5 intervals in), refused, refused (0.1 later), accepted (an interval later)
    time.sleep(0.5 * interval + interval + 0.1 * interval + interval + 0.5)
    sender.stop()
    times = [at for _, at in sent][:4]
    assert len(times) == 4, times
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # a loaded 2-core machine delays a thread's wake-up by tens of ms (rarely more): 0.8 s of margin on
    # either side separates a retry after 0.2 s from one after the 2-s interval
    assert gaps[0] >= interval - 0.05, gaps  # accepted: the next one an interval later
    assert gaps[1] < 0.2 * interval + 0.8, gaps  # refused after an accepted one: retried soon
    assert gaps[2] >= interval - 0.05, gaps  # refused again: back to the interval


def test_the_monitor_s_single_scan_names_the_lowest_rank_of_the_first_kind_whatever_the_order_heard():
    """`JobMonitor.check` scans the ranks once, unsorted (at 80,000 ranks three sorted scans took ~0.36 s of
    CPU, 10 times a second): the fault it names must still be the sorted scans' one, the lowest rank of the
    first kind (gone, then silent, then never heard from, then without progress), in whatever order the
    ranks were heard from."""
    import random

    from megascale.ft.config import Timeouts
    from megascale.ft.monitor import JobMonitor

    class Clock:
        now = 1000.0

        def __call__(self) -> float:
            return self.now

    world, clock = 1000, Clock()
    order = list(range(world + 1))  # rank 1000: a stray beat from outside the world (a previous attempt's)
    random.Random(0).shuffle(order)
    gone_pids: set[int] = set()
    timeouts = Timeouts(heartbeat_interval=1, hang_timeout=5, collective_timeout=10, startup_timeout=20)
    monitor = JobMonitor(world, timeouts, clock, gone=lambda beat: beat.pid in gone_pids)
    heard = [r for r in order if r != 17]  # rank 17 never heard from
    for rank in heard:
        monitor.on_heartbeat(Heartbeat(rank=rank, pid=10_000 + rank, step=1, pid_started=None))
    clock.now += 6  # past hang_timeout: everyone stalled; keep all but some beating (step unchanged)
    # several of each kind, the lowest not the last heard from: a scan keeping the last one it met fails
    silent, dead = heard[10:15], heard[100:105]
    assert min(silent) != silent[-1] and min(dead) != dead[-1]
    for rank in heard:
        if rank not in silent:
            monitor.on_heartbeat(Heartbeat(rank=rank, pid=10_000 + rank, step=1, pid_started=None))
    gone_pids.update(10_000 + rank for rank in dead)

    def named() -> tuple[str, int | None, str]:
        fault = monitor.check()
        assert fault is not None
        return fault.kind, fault.rank, fault.message

    assert named()[:2] == ("dead", min(dead))
    gone_pids.clear()
    assert named()[:2] == ("hung", min(silent)) and "no heartbeat" in named()[2]
    for rank in silent:
        monitor.on_heartbeat(Heartbeat(rank=rank, pid=10_000 + rank, step=1, pid_started=None))
    assert named()[:2] == ("hung", 0) and "has not advanced" in named()[2]  # none before startup_timeout
    clock.now += 15  # past startup_timeout: the rank never heard from comes before those without progress
    for rank in heard:
        monitor.on_heartbeat(Heartbeat(rank=rank, pid=10_000 + rank, step=1, pid_started=None))
    assert named()[:2] == ("hung", 17) and "never sent" in named()[2]
