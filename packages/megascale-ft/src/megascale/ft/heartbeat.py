"""Heartbeat transport: ranks POST JSON to the driver's HTTP(S) server; every heartbeat is signed with a
shared token and numbered, so forged and replayed ones are refused.

Why HTTP (stdlib ``http.server`` / ``urllib``) rather than torch's ``TCPStore``: the store has no notion of
a client's identity or a secret, so anyone who reaches its port could write into it. Here each heartbeat's
body carries the sender's sequence number and send time, and its ``X-Megascale-Signature`` header is the
HMAC-SHA256 of the body under the token (checked in constant time; the token itself never travels). The
server refuses, and logs with the peer's address, a bad signature (forged, or another job's token), a
sequence number not above the last one from that process (replayed), and a send time older than
``max_age`` (replayed later, e.g. to a restarted driver). Across nodes the heartbeats leave loopback: the
server then also needs TLS (stdlib ``ssl``, a certificate and key; ranks verify it against a CA file), so
nobody on the path reads the job's state either. It also keeps the driver free of torch.

Wire format: ``POST /heartbeat`` with the signature header and a JSON object (see `Heartbeat`). A second
header, ``X-Megascale-Request``, signs the path, the body's length and the send time: the server checks it
before reading the body, so a forged request cannot make it read (and hold) up to `MAX_BODY` bytes.

Under attack: the accepting thread only accepts (connections beyond `MAX_CONNECTIONS`, or `MAX_PER_PEER`
from one address, are closed at once); each connection's TLS handshake, and then its whole request, run on
its own thread within `IO_TIMEOUT` each, however slowly the bytes trickle in. A peer that connects and sends
nothing, or a node lost mid-handshake, holds up no one's heartbeats.
``GET /status`` (``Authorization: Bearer <token>``) returns the latest heartbeat of every rank. Across nodes,
each node's agent talks to the driver on ``POST /agent`` (`exchange`): signed, numbered and checked the same
way, and the driver's answer (the agent's orders) is signed too, so an agent obeys only its driver.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import ipaddress
import json
import logging
import os
import random
import select
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from megascale.ft._procs import start_time
from megascale.ft.config import DriverAddress, TLSConfig

__all__ = ["Heartbeat", "HeartbeatSender", "HeartbeatServer", "exchange", "post"]

log = logging.getLogger(__name__)

MAX_BODY = 4 << 20  # timings of a few hundred steps fit; anything larger is not a heartbeat
SIGNATURE = "X-Megascale-Signature"
REQUEST = "X-Megascale-Request"  # "<sent> <signature of path, length, sent>": checked before the body is read
IO_TIMEOUT = 10.0  # seconds a connection has for its TLS handshake, and then for its whole request
MAX_CONNECTIONS = 512  # connections served at once; more are closed at once
MAX_PER_PEER = 128  # of them from one address: one client cannot take them all
# connections closed unserved that report.json names one by one (the rest are counted)
MAX_DROPS_KEPT = 100
# connections waiting to be accepted: every node's agent and ranks may connect in the same few milliseconds
# (a step boundary, a restart); the kernel drops SYNs beyond it and the client retries only after 1 s
LISTEN_BACKLOG = 1024


def sign(token: str, body: bytes) -> str:
    """The signature header's value: HMAC-SHA256 of ``body`` under ``token``."""
    return "sha256=" + hmac.new(token.encode(), body, hashlib.sha256).hexdigest()


def sign_request(token: str, path: str, length: int, sent: str) -> str:
    """The request header's signature: of the path, the body's length and the send time, so the server
    can refuse a forged request before it reads (and buffers) a body of up to `MAX_BODY` bytes."""
    return sign(token, f"{path}\n{length}\n{sent}".encode())


class _DeadlineReader(io.RawIOBase):
    """A socket's bytes until one deadline for the whole request: a peer sending a byte now and then (slow
    loris) cannot keep a server thread, as it could under a per-read timeout."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock, self._deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive within the server's I/O timeout")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


@dataclass
class Heartbeat:
    """One report of a rank (executor) to the driver.

    ``progress`` counts work that is not a training step (validation batches, a long checkpoint load): the
    driver counts a change of ``step`` or ``progress`` as progress.

    ``status`` is "running", "finishing" (the last step is done: the final commit, a sample, teardown; given
    the startup timeout), "finished", "error" (an exception; ``message`` says which) or "nan" (a non-finite
    loss). ``events`` are the timing events since the previous heartbeat (see
    `megascale.ft.timing.StepTimer.drain`).
    """

    rank: int
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    attempt: int = 0
    step: int = -1
    progress: int = 0
    status: str = "running"
    message: str = ""
    loss: float | None = None
    last_step_time: float | None = None
    device_memory: int | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    sent: float = 0.0
    seq: int = 0  # per sending process, increasing: a repeated or older number is a replay
    coords: dict[str, int] | None = None  # this rank's parallel coordinates ({"dp": 0, "pp": 1, "tp": 0})
    node: str | None = None  # the node agent that started this rank (multi-node launches)
    # when ``pid`` started (ticks after boot, /proc/<pid>/stat): a launcher kills that pid only while it is
    # still this process, not another that reused the number
    pid_started: int | None = field(default_factory=lambda: start_time(os.getpid()))

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Heartbeat:
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        beat = cls(**known)
        if not isinstance(beat.rank, int) or not isinstance(beat.step, int):
            raise ValueError("rank and step must be integers")
        return beat


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the socket's own reader: replaced by one with a deadline for the whole request
        self.rfile = io.BufferedReader(
            _DeadlineReader(self.connection, time.monotonic() + self.server.io_timeout)
        )

    def _authorized(self) -> bool:
        given = self.headers.get("Authorization", "")
        expected = f"Bearer {self.server.token}"
        if hmac.compare_digest(given.encode(), expected.encode()):
            return True
        return self._refuse(401, "wrong or missing token")

    def _refuse(self, code: int, why: str) -> bool:
        self.server.refused += 1
        log.warning(
            "heartbeat server: refused a %s %s from %s:%s (%s)", self.command, self.path,
            *self.client_address[:2], why,
        )  # fmt: skip
        self._reply(code, {"error": why})
        return False

    def _fresh(self, who: str, key: tuple[Any, ...], sent: float, seq: int) -> bool:
        """Not a replay: a sequence number above the last from this process, sent within ``max_age``."""
        age = time.time() - sent
        if not -self.server.max_age < age < self.server.max_age:
            return self._refuse(409, f"replayed or stale {who} (sent {age:.0f} s ago)")
        with self.server.seq_lock:
            if seq <= self.server.last_seq.get(key, 0):
                return self._refuse(409, f"replayed {who} (sequence {seq})")
            self.server.last_seq[key] = seq
        return True

    def _reply(self, code: int, body: dict[str, Any], signed: bool = False) -> None:
        data = json.dumps(body).encode()
        self.connection.settimeout(self.server.io_timeout)  # the reader left the request's remaining time
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if signed:
            self.send_header(SIGNATURE, sign(self.server.token, data))
        self.end_headers()
        self.wfile.write(data)

    def _signed_json(self) -> dict[str, Any] | None:
        """The request's JSON object if its signature is the token's, else None (refused and logged)."""
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            self._refuse(400, "a Content-Length that is not a number")
            return None
        if not 0 < length <= MAX_BODY:
            self._refuse(413, f"a body of {length} bytes (at most {MAX_BODY})")
            return None
        sent, _, given = self.headers.get(REQUEST, "").partition(" ")
        if not hmac.compare_digest(
            given.encode(), sign_request(self.server.token, self.path, length, sent).encode()
        ):
            self._refuse(
                401,
                f"bad or missing signature (forged, or another job's token; its {length}-byte body left unread)",
            )
            return None
        try:
            age = time.time() - float(sent)
        except ValueError:
            age = float("inf")
        if not -self.server.max_age < age < self.server.max_age:
            self._refuse(409, f"replayed or stale request (sent {age:.0f} s ago; its body left unread)")
            return None
        body = self.rfile.read(length)
        given = self.headers.get(SIGNATURE, "")
        if not hmac.compare_digest(given.encode(), sign(self.server.token, body).encode()):
            self._refuse(401, "bad or missing signature (forged, or another job's token)")
            return None
        try:
            data = json.loads(body)
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            return data
        except ValueError as e:
            self._reply(400, {"error": str(e)})
            return None

    def do_POST(self) -> None:
        if self.path == "/agent" and self.server.on_agent is not None:
            self._agent()
            return
        if self.path != "/heartbeat":
            self._reply(404, {"error": f"no {self.path}"})
            return
        data = self._signed_json()
        if data is None:
            return
        try:
            beat = Heartbeat.from_json(data)
        except (ValueError, TypeError) as e:
            self._reply(400, {"error": str(e)})
            return
        if not self._fresh(
            f"heartbeat of rank {beat.rank}", (beat.rank, beat.host, beat.pid), beat.sent, beat.seq
        ):
            return
        self.server.deliver(beat)
        self._reply(200, {"ok": True})

    def _agent(self) -> None:
        data = self._signed_json()
        if data is None:
            return
        try:
            node, pid, sent, seq = str(data["node"]), int(data["pid"]), float(data["sent"]), int(data["seq"])
        except (KeyError, TypeError, ValueError) as e:
            self._reply(400, {"error": f"not an agent report: {e}"})
            return
        if not self._fresh(
            f"report of node {node}'s agent", ("agent", node, data.get("host"), pid), sent, seq
        ):
            return
        assert self.server.on_agent is not None
        self._reply(200, self.server.on_agent(data), signed=True)

    def do_GET(self) -> None:
        if not self._authorized():
            return
        if self.path != "/status":
            self._reply(404, {"error": f"no {self.path}"})
            return
        self._reply(200, {str(r): asdict(b) for r, b in self.server.latest.items()})

    def log_error(self, format: str, *args: Any) -> None:
        # http.server's word for a request that timed out or was malformed (and for the errors it sends)
        self.server.record_drop(self.client_address, format % args)
        log.warning("heartbeat server: %s:%s: " + format, *self.client_address[:2], *args)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("heartbeat server: " + format, *args)


class _Server(ThreadingHTTPServer):
    """One thread per connection, where the TLS handshake and the request run under `IO_TIMEOUT`; the
    accepting thread only accepts (a peer that sends nothing can hold up no one but itself), and turns
    connections beyond the caps away."""

    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG
    context: ssl.SSLContext | None
    io_timeout: float
    max_connections: int
    max_per_peer: int
    conn_lock: threading.Lock
    active: dict[str, int]  # peer address -> connections being served
    serving: int  # their sum, kept as a count: a sum over every peer per connection grows with the nodes
    turned_away: int
    dropped: list[dict[str, Any]]
    dropped_total: int
    token: str
    refused: int
    max_age: float
    seq_lock: threading.Lock
    last_seq: dict[tuple[Any, ...], int]
    latest: dict[int, Heartbeat]
    deliver: Callable[[Heartbeat], None]
    on_agent: Callable[[dict[str, Any]], dict[str, Any]] | None

    def process_request(self, request: Any, client_address: Any) -> None:
        peer = str(client_address[0])
        with self.conn_lock:
            full = self.serving >= self.max_connections or self.active.get(peer, 0) >= self.max_per_peer
            if not full:
                self.active[peer] = self.active.get(peer, 0) + 1
                self.serving += 1
            else:
                self.turned_away += 1
        if full:
            if self.turned_away % 100 == 1:
                log.warning("heartbeat server: %d connection(s) turned away, the last from %s (at most %d at once, "
                            "%d from one address)", self.turned_away, peer, self.max_connections,
                            self.max_per_peer)  # fmt: skip
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release(peer)
            raise

    def _release(self, peer: str) -> None:
        with self.conn_lock:
            self.active[peer] -= 1
            self.serving -= 1
            if not self.active[peer]:
                del self.active[peer]

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(str(client_address[0]))

    def finish_request(self, request: Any, client_address: Any) -> None:
        """On the connection's own thread: the TLS handshake, then the request."""
        if self.context is None:
            super().finish_request(request, client_address)
            return
        secure = None
        try:
            secure = self.context.wrap_socket(request, server_side=True, do_handshake_on_connect=False)
            self._handshake(secure)
        except (OSError, ValueError) as e:  # ssl.SSLError and TimeoutError are OSErrors
            log.warning("heartbeat server: no TLS handshake with %s:%s (%s)", *client_address[:2], e)
            self.record_drop(client_address, f"no TLS handshake: {e}")
            if secure is not None:  # else the caller closes the plain socket
                self.shutdown_request(secure)
            return
        try:
            super().finish_request(secure, client_address)
        finally:
            self.shutdown_request(secure)

    def _handshake(self, secure: ssl.SSLSocket) -> None:
        """Within `io_timeout` in all: a blocking handshake's timeout restarts with every byte received."""
        deadline = time.monotonic() + self.io_timeout
        secure.setblocking(False)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"not done within {self.io_timeout:.0f} s")
            try:
                secure.do_handshake()
                break
            except ssl.SSLWantReadError:
                select.select([secure], [], [], left)
            except ssl.SSLWantWriteError:
                select.select([], [secure], [], left)
        secure.setblocking(True)

    def record_drop(self, client_address: Any, why: str) -> None:
        """A connection closed without a request served (timed out, no TLS handshake, malformed): counted,
        and the first `MAX_DROPS_KEPT` kept for report.json (an idle or slow peer is named there)."""
        with self.conn_lock:
            self.dropped_total += 1
            if len(self.dropped) < MAX_DROPS_KEPT:
                self.dropped.append(
                    {"peer": f"{client_address[0]}:{client_address[1]}", "why": why, "at": time.time()}
                )

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a peer that vanished mid-request: not the server's error, and no traceback on stderr
        log.debug(
            "heartbeat server: connection from %s:%s ended in an error", *client_address[:2], exc_info=True
        )


class HeartbeatServer:
    """The driver's end: receives heartbeats on ``address`` and hands each to ``on_heartbeat``.

    Args:
        token: the shared secret heartbeats are signed with (at least 16 characters).
        on_heartbeat: called on a server thread for every accepted heartbeat.
        address: where to listen (loopback by default).
        tls: certificate and key to serve HTTPS with; required unless the address is loopback (heartbeats
            that leave the machine are encrypted as well as signed).
        max_age: seconds after which a heartbeat counts as replayed (clocks of the nodes must agree to
            within this).
        on_agent: answers a node agent's report (``POST /agent``) with its orders (multi-node driver).
        io_timeout: seconds a connection has for its TLS handshake, and then for its whole request (a peer
            that connects and sends nothing, or sends slowly, is closed after it).
        max_connections: connections served at once (more are closed at once) ...
        max_per_peer: ... of which from one address.
    """

    def __init__(
        self,
        token: str,
        on_heartbeat: Callable[[Heartbeat], None],
        address: DriverAddress | None = None,
        tls: TLSConfig | None = None,
        max_age: float = 120.0,
        on_agent: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        io_timeout: float = IO_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
        max_per_peer: int = MAX_PER_PEER,
    ) -> None:
        if len(token) < 16:
            raise ValueError("the heartbeat token must have at least 16 characters (use secrets.token_hex())")
        address = address or DriverAddress()
        require_tls_off_loopback(address.host, tls)
        family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
        server_class = type("_BoundServer", (_Server,), {"address_family": family})
        self._server: _Server = server_class((address.host, address.port), _Handler)
        self.tls = tls
        self._server.context = None
        if tls is not None:
            # the listening socket stays plain: each connection is wrapped, and shakes hands, on its own thread
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(tls.certfile, tls.keyfile)
            self._server.context = context
        self._server.io_timeout, self._server.conn_lock = io_timeout, threading.Lock()
        self._server.max_connections, self._server.max_per_peer = max_connections, max_per_peer
        self._server.active, self._server.serving, self._server.turned_away = {}, 0, 0
        self._server.dropped, self._server.dropped_total = [], 0
        self._server.token, self._server.refused, self._server.latest = token, 0, {}
        self._server.max_age, self._server.seq_lock, self._server.last_seq = max_age, threading.Lock(), {}
        self._server.on_agent = on_agent
        lock = threading.Lock()

        def deliver(beat: Heartbeat) -> None:
            with lock:
                self._server.latest[beat.rank] = beat
                on_heartbeat(beat)

        self._server.deliver = deliver
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True,
            name="megascale-ft-heartbeats",
        )  # fmt: skip
        self._thread.start()

    @property
    def host(self) -> str:
        return str(self._server.server_address[0])

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls is not None else 'http'}://{host}:{self.port}"

    def beats(self) -> list[Heartbeat]:
        """The latest heartbeat of every rank heard from since `forget`."""
        return list(self._server.latest.values())

    def forget(self) -> None:
        """Drop the ranks heard from (a new attempt starts)."""
        self._server.latest.clear()

    @property
    def refused(self) -> int:
        """Requests refused for a wrong or missing token."""
        return self._server.refused

    @property
    def turned_away(self) -> int:
        """Connections closed unheard because too many were open (`max_connections`, `max_per_peer`)."""
        return self._server.turned_away

    def connections(self) -> dict[str, Any]:
        """For report.json: connections closed unserved (the first few named, with why), turned away for
        the caps, and requests refused for a wrong token or signature."""
        with self._server.conn_lock:
            dropped = list(self._server.dropped)
        return {
            "dropped": dropped, "dropped_total": self._server.dropped_total,
            "turned_away": self.turned_away, "refused": self.refused,
        }  # fmt: skip

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> HeartbeatServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def require_tls_off_loopback(host: str, tls: TLSConfig | None) -> None:
    """Heartbeats that cross the network are encrypted as well as signed: off loopback, TLS is required."""
    if tls is None and not _is_loopback(host):
        raise ValueError(
            f"the heartbeat server binds {host}, off loopback: give it a TLS certificate and key "
            "(--tls-cert/--tls-key) so heartbeats that cross the network are encrypted as well as signed"
        )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_SEQ = iter(
    range(1, 1 << 62)
)  # this process's heartbeat numbers (several senders share it: still increasing)
_SEQ_LOCK = threading.Lock()


def _numbered(payload: dict[str, Any]) -> bytes:
    with _SEQ_LOCK:
        payload["seq"], payload["sent"] = next(_SEQ), time.time()
        return json.dumps(payload).encode()


_CONTEXTS: dict[tuple[str | None, int], ssl.SSLContext] = {}
_CONTEXTS_LOCK = threading.Lock()


def _client_context(cafile: str | None) -> ssl.SSLContext:
    """The TLS context that verifies the driver against ``cafile``, made once per file version: building one
    reads and parses the CA file, 1-2 ms of CPU that every heartbeat and agent report paid again. A
    context is safe to share between threads; a replaced CA file (another mtime) gets a fresh one."""
    try:
        version = os.stat(cafile).st_mtime_ns if cafile else 0
    except OSError:
        version = -1  # let ssl say what is wrong with the file
    with _CONTEXTS_LOCK:
        context = _CONTEXTS.get((cafile, version))
        if context is None:
            context = ssl.create_default_context(cafile=cafile)
            _CONTEXTS.clear()  # one CA file per process in practice: no growth on rotation
            _CONTEXTS[(cafile, version)] = context
        return context


def _send(
    url: str, token: str, path: str, body: bytes, timeout: float, cafile: str | None
) -> tuple[bytes, str]:
    sent = repr(time.time())
    request = urllib.request.Request(
        f"{url}{path}", data=body, method="POST",
        headers={SIGNATURE: sign(token, body), REQUEST: f"{sent} {sign_request(token, path, len(body), sent)}",
                 "Content-Type": "application/json"},
    )  # fmt: skip
    context = _client_context(cafile) if url.startswith("https:") else None
    with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
        return response.read(), response.headers.get(SIGNATURE, "")


def post(url: str, token: str, beat: Heartbeat, timeout: float, cafile: str | None = None) -> None:
    """Send one heartbeat, numbered and signed; raises ``urllib.error.URLError``/``HTTPError`` when it is
    not accepted. ``cafile``: the certificate (or CA) an ``https`` driver is verified against."""
    payload = asdict(beat)
    body = _numbered(payload)
    beat.seq, beat.sent = payload["seq"], payload["sent"]
    _send(url, token, "/heartbeat", body, timeout, cafile)


def exchange(
    url: str, token: str, report: dict[str, Any], timeout: float, cafile: str | None = None
) -> dict[str, Any]:
    """A node agent's report to the driver (``POST /agent``, numbered and signed) and the driver's answer,
    whose signature is checked: ``ValueError`` if it was not signed with the token."""
    data, signature = _send(url, token, "/agent", _numbered(dict(report)), timeout, cafile)
    if not hmac.compare_digest(signature.encode(), sign(token, data).encode()):
        raise ValueError(f"the answer from {url} is not signed with the job's token: not our driver")
    answer = json.loads(data)
    if not isinstance(answer, dict):
        raise ValueError(f"the answer from {url} is not a JSON object")
    return answer


class HeartbeatSender:
    """The rank's end: a daemon thread that sends ``snapshot()`` every ``interval`` seconds.

    ``send_now`` sends synchronously (anomalies must reach the driver before the rank dies). Delivery
    failures are logged once and retried with the next beat: a rank never dies because the driver was
    briefly unreachable (the driver notices missing heartbeats instead).

    Every rank of a job starts its sender at about the same moment (after the rendezvous), so the first
    periodic beat comes at a random point of the first interval: otherwise the whole job's beats would reach
    the driver as one burst every interval, a connection per rank at once (~4 ms of the driver's CPU each
    over TLS), and beyond `MAX_CONNECTIONS` ranks the server turns the rest away (benchmarks/ft_scale.py). A
    beat that is not accepted after one that was is retried once at a random moment within a fifth of the
    interval, not an interval later; while the driver stays unreachable, the sender keeps to the interval
    (no faster retries that a restarting driver would meet all at once).
    """

    def __init__(
        self,
        url: str,
        token: str,
        interval: float,
        snapshot: Callable[[], Heartbeat],
        cafile: str | None = None,
    ) -> None:
        self.url, self._token, self.interval, self._snapshot = url, token, interval, snapshot
        self.cafile = cafile
        self._stop = threading.Event()
        self._send_lock = threading.Lock()
        self._warned = False
        # the jitter's own generator: drawing from the global one would move the training's Python RNG at
        # moments that depend on the network (a resumed run would no longer repeat bit for bit)
        self._jitter = random.Random()
        self._thread = threading.Thread(target=self._run, daemon=True, name="megascale-ft-heartbeat")

    def start(self) -> None:
        self._thread.start()

    def send_now(self, beat: Heartbeat | None = None) -> bool:
        """Send one heartbeat (``snapshot()`` by default) now; True when the driver accepted it."""
        with self._send_lock:  # one request at a time keeps heartbeats in order
            try:
                post(self.url, self._token, beat or self._snapshot(), timeout=max(self.interval, 1.0),
                     cafile=self.cafile)  # fmt: skip
                return True
            except (OSError, urllib.error.URLError) as e:
                if not self._warned:
                    log.warning(
                        "heartbeat to %s failed (%s); retrying every %.1f s", self.url, e, self.interval
                    )
                    self._warned = True
                return False

    def _run(self) -> None:
        wait, ok = self._jitter.uniform(0.0, self.interval), True
        while not self._stop.wait(wait):
            was_ok, ok = ok, self.send_now()
            wait = self._jitter.uniform(0.0, 0.2 * self.interval) if was_ok and not ok else self.interval

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval + 2)
