"""megascale-ft under attack: connections that stall the driver's server, forged requests, a token file others
can read, a pid reused by another process. Threads in one process; seconds in all."""

from __future__ import annotations

import logging
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time

import pytest

from megascale.ft._procs import kill_tree, pid_alive, start_time
from megascale.ft.config import TLSConfig
from megascale.ft.heartbeat import MAX_BODY, Heartbeat, HeartbeatServer, post
from tests.ft.test_heartbeat import TOKEN, _self_signed

IO_TIMEOUT = 4.0  # the server's, in these tests
PROMPT = 2.0  # a heartbeat's bound while attacked: generous for a loaded 2-core machine, half the I/O timeout


def _closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed ``sock`` (EOF or reset), None if it stayed open that long."""
    start = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return None
    except OSError:
        pass
    return time.monotonic() - start


def test_idle_slow_and_oversized_connections_do_not_hold_up_heartbeats(tmp_path):
    """An idle TCP connection (no TLS handshake: it stalled the accepting thread, and every heartbeat with
    it), a slow-loris client trickling its headers, and an oversized body, all open while heartbeats flow:
    each heartbeat is accepted promptly, and the attackers are closed after the I/O timeout."""
    cert, key = _self_signed(tmp_path)
    received: list[Heartbeat] = []
    with HeartbeatServer(TOKEN, received.append, tls=TLSConfig(cert, key), io_timeout=IO_TIMEOUT) as server:
        address = (server.host, server.port)
        idle = socket.create_connection(address)
        client = ssl.create_default_context(cafile=cert)
        loris = client.wrap_socket(socket.create_connection(address), server_hostname="127.0.0.1")
        loris.sendall(b"POST /heartbeat HTTP/1.1\r\nHost: x\r\n")
        stop = threading.Event()

        def trickle() -> None:  # a byte every 0.2 s: never idle long enough for a per-read timeout
            while not stop.wait(0.2):
                try:
                    loris.send(b"X")
                except OSError:
                    return

        threading.Thread(target=trickle, daemon=True).start()
        oversized = client.wrap_socket(socket.create_connection(address), server_hostname="127.0.0.1")
        oversized.sendall(f"POST /heartbeat HTTP/1.1\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n".encode())
        try:
            for step in range(4):
                started = time.monotonic()
                post(server.url, TOKEN, Heartbeat(rank=0, step=step), timeout=2 * IO_TIMEOUT, cafile=cert)
                assert time.monotonic() - started < PROMPT, f"heartbeat {step} held up by the attackers"
            assert [b.step for b in received] == [0, 1, 2, 3]
            assert oversized.recv(100).startswith(b"HTTP/1.0 413")  # refused without waiting for the body
            # the idle and the slow one are closed after the I/O timeout (the trickle notwithstanding)
            limit = IO_TIMEOUT + PROMPT
            assert _closed_within(idle, limit) is not None, "an idle connection kept open"
            assert _closed_within(loris, limit) is not None, "a slow-loris connection kept open"
            # and named for report.json: the idle one never shook hands, the slow one timed out, the
            # oversized one was refused (counted, as a wrong token is)
            report = server.connections()
            whys = sorted(d["why"].split(":")[0] for d in report["dropped"])
            assert whys == ["Request timed out", "no TLS handshake"], report
            assert report["dropped_total"] == 2 and report["refused"] == 1, report
            assert all(d["peer"].startswith("127.0.0.1:") for d in report["dropped"]), report
        finally:
            stop.set()
            for sock in (idle, loris, oversized):
                sock.close()


def test_a_forged_request_is_refused_before_its_body_is_read(caplog):
    """Headers announcing a body of MAX_BODY bytes, without the token's request signature: refused at once,
    with nothing of the body sent (a server that read the body first would wait for it)."""
    caplog.set_level(logging.WARNING, logger="megascale.ft.heartbeat")
    agents: list[dict] = []
    with HeartbeatServer(
        TOKEN, print, io_timeout=IO_TIMEOUT, on_agent=lambda r: agents.append(r) or {}
    ) as server:
        for forged in ("", f"{time.time()!r} sha256=" + "0" * 64):
            with socket.create_connection((server.host, server.port)) as sock:
                header = f"X-Megascale-Request: {forged}\r\n" if forged else ""
                sock.sendall(f"POST /agent HTTP/1.1\r\n{header}Content-Length: {MAX_BODY}\r\n\r\n".encode())
                sock.settimeout(PROMPT)
                assert sock.recv(100).startswith(b"HTTP/1.0 401")
        assert server.refused == 2 and agents == []
        assert f"its {MAX_BODY}-byte body left unread" in caplog.text
        post(server.url, TOKEN, Heartbeat(rank=0), timeout=5)  # the token's own still gets in


def test_connections_beyond_the_cap_are_turned_away_at_once():
    with HeartbeatServer(TOKEN, lambda beat: None, io_timeout=IO_TIMEOUT, max_per_peer=3) as server:
        held = [socket.create_connection((server.host, server.port)) for _ in range(3)]
        try:
            time.sleep(0.2)  # accepted and being served
            with socket.create_connection((server.host, server.port)) as extra:
                assert _closed_within(extra, PROMPT) is not None
            assert server.turned_away == 1
        finally:
            for sock in held:
                sock.close()
        deadline = time.monotonic() + PROMPT
        while True:  # their threads end once the server sees them closed
            try:
                post(server.url, TOKEN, Heartbeat(rank=0), timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.05)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_token_file_others_can_read_is_refused_by_name(tmp_path, mode, capsys):
    from megascale.ft.cli import main

    path = tmp_path / "token"
    path.write_text(TOKEN)
    path.chmod(mode)
    assert main(["launch", "--token-file", str(path), "--", "train.py"]) == 2
    err = capsys.readouterr().err
    assert f"chmod 600 {path}" in err and "readable or writable by group or others" in err


def test_a_reused_pid_is_not_killed(caplog):
    """A pid recorded with its start time is killed only while it is still that process: the same number
    under another start time (an unrelated process that reused it) is left alone, and the log says so."""
    caplog.set_level(logging.WARNING, logger="megascale.ft")
    root = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = start_time(stranger.pid)
        assert started is not None
        kill_tree(root.pid, extra={stranger.pid: started - 1}, wait=1.0)  # recorded: an earlier process
        assert root.wait(timeout=5) == -signal.SIGKILL
        assert pid_alive(stranger.pid), "killed a process that reused a recorded pid"
        assert f"not signalling pid {stranger.pid}: it was reused" in caplog.text
        # the process recorded: killed
        root = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        kill_tree(root.pid, extra={stranger.pid: started}, wait=5.0)
        assert stranger.wait(timeout=5) == -signal.SIGKILL
    finally:
        for process in (root, stranger):
            process.kill()
            process.wait()


def test_the_agent_reports_a_reused_pid_gone_and_sends_it_no_signal(tmp_path):
    from megascale.ft.agent import AgentConfig, NodeAgent

    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        agent = NodeAgent(["true"], AgentConfig("n0", "http://127.0.0.1:1", TOKEN, run_dir=str(tmp_path)))
        started = start_time(stranger.pid)
        assert started is not None
        agent.known, agent.attempt = {stranger.pid: started - 1, os.getpid(): start_time(os.getpid())}, 0
        report = agent._report()
        assert report["gone"] == [stranger.pid] and report["alive"] == [os.getpid()]
        agent._collect_stacks(0, {"0": stranger.pid})  # SIGUSR1 would end it
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def test_the_rendezvous_store_listens_on_its_address_only():
    """The store has no authentication: it listens on the address given (loopback by default), not on every
    interface as torch's own TCPStore does whatever host it is given."""
    from megascale.ft.driver import ClusterConfig, _rendezvous_store

    with _rendezvous_store(None, "127.0.0.1") as stores:
        for endpoint in (stores.endpoint, stores.fresh()):  # torchrun's store, and a warm attempt's
            host, port = endpoint.rsplit(":", 1)
            assert host == "127.0.0.1"
            socket.create_connection((host, int(port)), timeout=5).close()
            # 127.0.0.2 is this machine too, not the address bound
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.2", int(port)), timeout=5)
    with pytest.raises(ValueError, match="refusing to bind the rendezvous store"):
        ClusterConfig(token=TOKEN, rdzv_endpoint="0.0.0.0:29400")
