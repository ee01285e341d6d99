"""Heartbeat transport and the driver's judgement: token, bind address, timeouts, fault attribution."""

from __future__ import annotations

import http.client
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict

import pytest

from megascale.ft.config import DriverAddress, Timeouts, TLSConfig
from megascale.ft.executor import Executor, NonFiniteLossError
from megascale.ft.heartbeat import REQUEST, SIGNATURE, Heartbeat, HeartbeatServer, post, sign, sign_request
from megascale.ft.monitor import JobMonitor

TOKEN = "0123456789abcdef0123"


@pytest.fixture
def server():
    received: list[Heartbeat] = []
    with HeartbeatServer(TOKEN, received.append) as s:
        s.received = received
        yield s


def test_a_heartbeat_with_the_token_is_delivered(server):
    post(server.url, TOKEN, Heartbeat(rank=3, step=7, status="running"), timeout=5)
    assert [(b.rank, b.step) for b in server.received] == [(3, 7)]
    assert server.beats()[0].pid == os.getpid()


@pytest.mark.parametrize("token", ["wrong-token-wrong-token", ""], ids=["wrong", "missing"])
def test_a_wrong_or_missing_token_is_refused_and_logged(server, token, caplog):
    caplog.set_level(logging.WARNING, logger="megascale.ft.heartbeat")
    with pytest.raises(urllib.error.HTTPError) as refused:
        post(server.url, token, Heartbeat(rank=0), timeout=5)
    assert refused.value.code == 401
    assert server.received == [] and server.refused == 1
    assert (
        "refused a POST /heartbeat from 127.0.0.1" in caplog.text
        and "bad or missing signature" in caplog.text
    )
    status = urllib.request.Request(f"{server.url}/status", headers={"Authorization": f"Bearer {token}"})
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(status, timeout=5)


def test_the_server_listens_on_loopback_only(server):
    assert server.host == "127.0.0.1"
    # 127.0.0.2 is this machine too, but not the address bound: nothing may answer there
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", server.port), timeout=5).close()
    outward = _outward_address()
    if outward is not None:
        with pytest.raises((ConnectionRefusedError, TimeoutError)):
            socket.create_connection((outward, server.port), timeout=5).close()


def _outward_address() -> str | None:
    """This machine's address on its default route, if it has one (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_binding_every_interface_needs_an_explicit_yes():
    with pytest.raises(ValueError, match="every interface"):
        DriverAddress(host="0.0.0.0")
    assert DriverAddress(host="0.0.0.0", allow_any=True).host == "0.0.0.0"
    with pytest.raises(ValueError, match="at least 16"):
        HeartbeatServer("short", lambda beat: None)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(heartbeat_interval=2, hang_timeout=3), "at least twice heartbeat_interval"),
        (dict(hang_timeout=30, collective_timeout=30), "longer than hang_timeout"),
        (dict(heartbeat_interval=0), "must be > 0"),
        (dict(hang_timeout=60, startup_timeout=10), "startup_timeout"),
    ],
)
def test_timeouts_form_one_validated_hierarchy(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Timeouts(**kwargs)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _monitor(world: int = 2) -> tuple[JobMonitor, _Clock]:
    clock = _Clock()
    timeouts = Timeouts(heartbeat_interval=1, hang_timeout=5, collective_timeout=10, startup_timeout=20)
    return JobMonitor(world, timeouts, clock), clock


def _beat(
    rank: int, step: int, status: str = "running", pid: int | None = None, message: str = ""
) -> Heartbeat:
    return Heartbeat(rank=rank, step=step, status=status, pid=pid or os.getpid(), message=message)


def test_a_rank_that_stops_beating_is_hung_and_named_before_its_waiting_peer():
    monitor, clock = _monitor()
    for step in range(3):
        clock.now += 1
        monitor.on_heartbeat(_beat(0, step))
        monitor.on_heartbeat(_beat(1, step))
    assert monitor.check() is None
    for _ in range(6):  # rank 1 falls silent; rank 0 keeps beating but its step stays (it waits for rank 1)
        clock.now += 1
        monitor.on_heartbeat(_beat(0, 2))
    fault = monitor.check()
    assert fault is not None and (fault.kind, fault.rank) == ("hung", 1)
    assert fault.latency == pytest.approx(6.0)


def test_a_frozen_rank_is_named_even_when_its_waiting_peer_stalled_first():
    """Seen in the chaos soak: the peer's last step ended a while before the frozen rank's last heartbeat, so
    the peer's stall passes hang_timeout first. The rank whose heartbeats stopped is named, not the peer."""
    monitor, clock = _monitor()
    monitor.on_heartbeat(_beat(0, 2))  # rank 0's last progress: t=0
    monitor.on_heartbeat(_beat(1, 2))
    clock.now += 1  # rank 1 computes its step on, beating; rank 0 waits for it (no progress)
    monitor.on_heartbeat(_beat(0, 2))
    monitor.on_heartbeat(_beat(1, 2))
    for _ in range(5):  # rank 1 is frozen at t=1: silent, but not yet beyond hang_timeout (5 s)
        clock.now += 1
        monitor.on_heartbeat(_beat(0, 2))
    fault = monitor.check()  # t=6: rank 0 stalled 6 s > 5 s; rank 1 silent 5 s, 5 heartbeat intervals
    assert fault is not None and (fault.kind, fault.rank) == ("hung", 1), fault
    assert "no heartbeat" in fault.message and fault.latency == pytest.approx(5.0)


def test_a_rank_that_beats_without_progress_is_hung():
    monitor, clock = _monitor(world=1)
    monitor.on_heartbeat(_beat(0, 4))
    for _ in range(4):
        clock.now += 1
        monitor.on_heartbeat(_beat(0, 4))
    assert monitor.check() is None  # 4 s without progress, limit 5
    clock.now += 2
    monitor.on_heartbeat(_beat(0, 4))
    fault = monitor.check()
    assert fault is not None and fault.kind == "hung" and "has not advanced" in fault.message


def test_progress_outside_steps_such_as_validation_is_not_a_hang():
    monitor, clock = _monitor(world=1)
    monitor.on_heartbeat(_beat(0, 4))
    for progress in range(1, 9):  # 8 s of validation batches at step 4
        clock.now += 1
        beat = _beat(0, 4)
        beat.progress = progress
        monitor.on_heartbeat(beat)
    assert monitor.check() is None
    clock.now += 6
    beat.sent += 1  # a later beat, same progress
    monitor.on_heartbeat(beat)
    assert monitor.check() is not None


def test_startup_may_take_longer_than_a_step_but_not_forever():
    monitor, clock = _monitor(world=2)
    monitor.on_heartbeat(_beat(0, -1))
    clock.now += 10  # loading a checkpoint: longer than hang_timeout is fine before the first step
    monitor.on_heartbeat(_beat(0, -1))
    assert monitor.check() is None
    clock.now += 11
    monitor.on_heartbeat(_beat(0, -1))
    fault = monitor.check()
    assert fault is not None and (fault.kind, fault.rank) == ("hung", 1)  # silent since the start
    assert fault.message.startswith("never sent a heartbeat")
    monitor.on_heartbeat(_beat(1, 0))
    fault = monitor.check()  # rank 0 still has no first step after 21 s
    assert fault is not None and (fault.kind, fault.rank) == ("hung", 0) and "step -1" in fault.message


def test_after_its_last_step_a_rank_may_work_without_progress_until_the_startup_timeout():
    """A final checkpoint's commit or a sample at the end of training has no steps: a rank that reported
    "finishing" is given startup_timeout (20 s here), not hang_timeout (5 s); it is still hung after that,
    and dead when its process is gone."""
    monitor, clock = _monitor(world=2)
    for rank in (0, 1):
        monitor.on_heartbeat(_beat(rank, 9))
    for rank in (0, 1):
        monitor.on_heartbeat(_beat(rank, 9, status="finishing"))
    clock.now += 15
    for rank in (0, 1):
        monitor.on_heartbeat(_beat(rank, 9, status="finishing"))
    assert monitor.check() is None
    clock.now += 6
    monitor.on_heartbeat(_beat(0, 9, status="finished"))
    monitor.on_heartbeat(_beat(1, 9, status="finishing"))
    fault = monitor.check()
    assert fault is not None and (fault.kind, fault.rank) == ("hung", 1) and "limit 20" in fault.message
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    monitor.on_heartbeat(_beat(1, 9, status="finishing", pid=gone.pid))
    fault = monitor.check()
    assert fault is not None and (fault.kind, fault.rank) == ("dead", 1)


def test_a_dead_process_is_blamed_before_the_peer_whose_collective_it_broke():
    monitor, clock = _monitor()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    monitor.on_heartbeat(_beat(0, 3))
    monitor.on_heartbeat(_beat(1, 3, pid=gone.pid))
    clock.now += 0.5
    monitor.on_heartbeat(_beat(0, 3, status="error", message="RuntimeError: Connection closed by peer"))
    fault = monitor.check()
    assert fault is not None and (fault.kind, fault.rank) == ("dead", 1)


def test_a_rank_with_a_cause_of_its_own_is_named_before_the_peer_whose_collective_broke_first():
    """A node's data reader died: its ranks raise about it, their pipeline peers about the broken connection,
    and the peers' reports may arrive first. The cause is named, not the consequence; a second cause does not
    replace the first."""
    monitor, clock = _monitor()
    for rank in (0, 1, 2):
        monitor.on_heartbeat(_beat(rank, 3))
    clock.now += 0.5
    broken = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:37814"
    monitor.on_heartbeat(_beat(2, 3, status="error", message=broken))
    monitor.on_heartbeat(
        _beat(0, 3, status="error", message="DataSourceError: the data reader of node 0 died")
    )
    monitor.on_heartbeat(_beat(1, 3, status="error", message="DataSourceError: the data reader died, too"))
    fault = monitor.check()
    assert fault is not None and (fault.kind, fault.rank) == ("exception", 0), fault
    assert "data reader of node 0" in fault.message


def test_reported_anomalies_become_faults_with_their_message():
    monitor, clock = _monitor()
    monitor.on_heartbeat(_beat(0, 3))
    monitor.on_heartbeat(_beat(1, 3))
    clock.now += 1
    monitor.on_heartbeat(_beat(1, 4, status="nan", message="loss is nan at step 4"))
    fault = monitor.check()
    assert fault is not None and (fault.kind, fault.rank, fault.message) == (
        "nan",
        1,
        "loss is nan at step 4",
    )
    same = type(fault)("nan", 1, "h", "loss is nan at step 9", 0, 0)
    assert same.signature == fault.signature  # numbers do not make a failure different


def test_the_executor_reports_steps_nan_and_exceptions_to_the_driver(server):
    timeouts = Timeouts(heartbeat_interval=0.2, hang_timeout=1, collective_timeout=2)
    executor = Executor(rank=2, url=server.url, token=TOKEN, timeouts=timeouts, attempt=1)
    with executor:
        with executor.timer.step(0):
            time.sleep(0.01)
        executor.step_done(0, 1.5)
        time.sleep(0.5)  # a couple of background beats carry step 0 and its timings
        with pytest.raises(NonFiniteLossError, match="loss is nan at step 1"):
            executor.step_done(1, float("nan"))
    statuses = [(b.step, b.status) for b in server.received]
    assert (0, "running") in statuses and (1, "nan") in statuses
    nan = next(b for b in server.received if b.status == "nan")
    assert nan.attempt == 1 and nan.rank == 2 and "loss is nan at step 1" in nan.message
    assert any(e["name"] == "step" for b in server.received for e in b.events)
    assert json.loads(json.dumps(server.received[-1].__dict__))  # JSON all the way

    def fail_inside() -> None:
        with Executor(rank=0, url=server.url, token=TOKEN, timeouts=timeouts):
            raise ValueError("bad batch")

    with pytest.raises(ValueError, match="bad batch"):
        fail_inside()
    assert (
        server.received[-1].status == "error" and "ValueError: bad batch at " in server.received[-1].message
    )


def test_outside_the_launcher_the_executor_is_inert(monkeypatch):
    monkeypatch.delenv("MEGASCALE_FT_URL", raising=False)
    with Executor.from_env() as executor:
        assert not executor.enabled
        executor.step_done(0, 1.0)


def _signed(body: dict, token: str = TOKEN, path: str = "/heartbeat") -> urllib.request.Request:
    data, sent = json.dumps(body).encode(), repr(time.time())
    headers = {SIGNATURE: sign(token, data), REQUEST: f"{sent} {sign_request(token, path, len(data), sent)}"}
    return urllib.request.Request(f"http://unused{path}", data=data, method="POST", headers=headers)


def _send(server, request: urllib.request.Request) -> int:
    request.full_url = f"{server.url}/heartbeat"
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_replayed_or_stale_heartbeat_is_refused_and_logged(server, caplog):
    """What an eavesdropper could do with a captured heartbeat: send it again (same sequence number), or
    later (an old one, e.g. to a restarted driver). A forged one (edited after signing) fails the signature."""
    caplog.set_level(logging.WARNING, logger="megascale.ft.heartbeat")
    beat = {**asdict(Heartbeat(rank=1, step=5)), "seq": 7, "sent": time.time()}
    assert _send(server, _signed(beat)) == 200
    assert _send(server, _signed(beat)) == 409  # the same heartbeat again
    assert _send(server, _signed({**beat, "seq": 6, "step": 6})) == 409  # an older number
    assert _send(server, _signed({**beat, "seq": 8, "sent": time.time() - 3600})) == 409  # an hour old
    forged = _signed({**beat, "seq": 9})
    forged.data = json.dumps({**beat, "seq": 9, "step": 99}).encode()  # edited after signing
    assert _send(server, forged) == 401
    assert [b.step for b in server.received] == [5] and server.refused == 4
    assert "replayed heartbeat of rank 1 (sequence 7)" in caplog.text and "stale heartbeat" in caplog.text
    post(server.url, TOKEN, Heartbeat(rank=1, step=6), timeout=5)  # the sender's own next one goes through
    assert [b.step for b in server.received] == [5, 6]


def _self_signed(tmp_path) -> tuple[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    from tests.ft._sim_agents import self_signed_certificate

    return self_signed_certificate(tmp_path)


def test_heartbeats_over_tls_are_delivered_and_verified(tmp_path):
    cert, key = _self_signed(tmp_path)
    received: list[Heartbeat] = []
    with HeartbeatServer(TOKEN, received.append, tls=TLSConfig(cert, key)) as tls_server:
        assert tls_server.url.startswith("https://127.0.0.1:")
        post(tls_server.url, TOKEN, Heartbeat(rank=2, step=1), timeout=5, cafile=cert)
        assert [b.rank for b in received] == [2]
        with pytest.raises(
            urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"
        ):  # an unknown certificate
            post(tls_server.url, TOKEN, Heartbeat(rank=2, step=2), timeout=5)
        # plain HTTP to a TLS server: refused by the handshake (how depends on timing: reset, or an error reply)
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            post(tls_server.url.replace("https", "http"), TOKEN, Heartbeat(rank=2, step=3), timeout=5)
    assert len(received) == 1


def test_off_loopback_the_server_needs_tls():
    with pytest.raises(ValueError, match="off loopback: give it a TLS certificate"):
        HeartbeatServer(TOKEN, lambda beat: None, DriverAddress(host="0.0.0.0", allow_any=True))


def test_agent_reports_are_signed_both_ways_and_replays_refused(caplog):
    """A node agent's report (POST /agent) is checked like a heartbeat, and the driver's orders come back
    signed: an agent obeys only a server that holds the token."""
    from megascale.ft.heartbeat import exchange

    caplog.set_level(logging.WARNING, logger="megascale.ft.heartbeat")
    seen: list[dict] = []

    def orders(report: dict) -> dict:
        seen.append(report)
        return {"action": "wait", "for": report["node"]}

    with HeartbeatServer(TOKEN, lambda beat: None, on_agent=orders) as server:
        report = {"node": "n1", "host": "h", "pid": 1}
        assert exchange(server.url, TOKEN, report, timeout=5) == {"action": "wait", "for": "n1"}
        with pytest.raises(urllib.error.HTTPError) as refused:
            exchange(server.url, "another-jobs-token-0000", report, timeout=5)
        assert refused.value.code == 401
        replay = _signed({**report, "seq": seen[0]["seq"], "sent": seen[0]["sent"]}, path="/agent")
        replay.full_url = f"{server.url}/agent"
        with pytest.raises(urllib.error.HTTPError) as replayed:
            urllib.request.urlopen(replay, timeout=5)
        assert replayed.value.code == 409 and "replayed report of node n1's agent" in caplog.text
        assert len(seen) == 1
    # a server that answers without the token (not our driver): the agent refuses its orders
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread

    class Impostor(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            body = b'{"action": "stop"}'
            self.send_response(200)
            self.send_header(SIGNATURE, sign("not-the-token-0123456", body))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    impostor = ThreadingHTTPServer(("127.0.0.1", 0), Impostor)
    Thread(target=impostor.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ValueError, match="not signed with the job's token"):
            exchange(f"http://127.0.0.1:{impostor.server_address[1]}", TOKEN, report, timeout=5)
    finally:
        impostor.shutdown()
        impostor.server_close()


def test_the_heartbeat_thread_never_draws_from_the_training_s_python_rng():
    """The sender's jitter (at start, and after a failed beat) must not move `random`'s global state: the
    training's Python RNG is checkpointed, and draws at moments set by the network made a resumed run differ
    from an uninterrupted one (found by the chaos soak: a slowed rank's failing beats)."""
    import random

    from megascale.ft.heartbeat import HeartbeatSender

    with socket.socket() as s:  # a port nobody listens on: every beat fails at once
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    random.seed(1234)
    before = random.getstate()
    beat = Heartbeat(rank=0, step=0)
    sender = HeartbeatSender(url, "t" * 32, 0.05, lambda: beat)
    sender.start()
    time.sleep(0.6)  # the first jittered wait, failures, jittered retries
    sender.stop()
    assert sender._warned  # the beats did fail: the retry path ran
    assert random.getstate() == before
