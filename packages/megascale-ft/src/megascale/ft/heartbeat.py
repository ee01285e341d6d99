"""Heartbeat transport: ranks POST JSON to the driver's HTTP server, which requires a shared token.

Why HTTP (stdlib ``http.server`` / ``urllib``) rather than torch's ``TCPStore``: the store has no notion of
a client's identity or a secret, so anyone who reaches its port could write into it; an HTTP request
carries a bearer token the server checks in constant time, and a refused request is logged with its
peer address. It also keeps the driver free of torch.

Wire format: ``POST /heartbeat`` with ``Authorization: Bearer <token>`` and a JSON object (see
`Heartbeat`). ``GET /status`` (same token) returns the latest heartbeat of every rank.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from megascale.ft.config import DriverAddress

__all__ = ["Heartbeat", "HeartbeatSender", "HeartbeatServer"]

log = logging.getLogger(__name__)

MAX_BODY = 4 << 20  # timings of a few hundred steps fit; anything larger is not a heartbeat


@dataclass
class Heartbeat:
    """One report of a rank (executor) to the driver.

    ``progress`` counts work that is not a training step (validation batches, a long checkpoint load): the
    driver counts a change of ``step`` or ``progress`` as progress.

    ``status`` is "running", "finished", "error" (an exception; ``message`` says which) or "nan" (a
    non-finite loss). ``events`` are the timing events since the previous heartbeat (see
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

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Heartbeat:
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        beat = cls(**known)
        if not isinstance(beat.rank, int) or not isinstance(beat.step, int):
            raise ValueError("rank and step must be integers")
        return beat


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def _authorized(self) -> bool:
        given = self.headers.get("Authorization", "")
        expected = f"Bearer {self.server.token}"
        if hmac.compare_digest(given.encode(), expected.encode()):
            return True
        self.server.refused += 1
        log.warning(
            "heartbeat server: refused a %s %s from %s:%s (wrong or missing token)",
            self.command, self.path, *self.client_address[:2],
        )  # fmt: skip
        self._reply(401, {"error": "wrong or missing token"})
        return False

    def _reply(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        if not self._authorized():
            return
        if self.path != "/heartbeat":
            self._reply(404, {"error": f"no {self.path}"})
            return
        length = int(self.headers.get("Content-Length", "0"))
        if not 0 < length <= MAX_BODY:
            self._reply(413, {"error": f"body of {length} bytes"})
            return
        try:
            beat = Heartbeat.from_json(json.loads(self.rfile.read(length)))
        except (ValueError, TypeError) as e:
            self._reply(400, {"error": str(e)})
            return
        self.server.deliver(beat)
        self._reply(200, {"ok": True})

    def do_GET(self) -> None:
        if not self._authorized():
            return
        if self.path != "/status":
            self._reply(404, {"error": f"no {self.path}"})
            return
        self._reply(200, {str(r): asdict(b) for r, b in self.server.latest.items()})

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("heartbeat server: " + format, *args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    token: str
    refused: int
    latest: dict[int, Heartbeat]
    deliver: Callable[[Heartbeat], None]


class HeartbeatServer:
    """The driver's end: receives heartbeats on ``address`` and hands each to ``on_heartbeat``.

    Args:
        token: the shared secret every request must carry (at least 16 characters).
        on_heartbeat: called on a server thread for every accepted heartbeat.
        address: where to listen (loopback by default).
    """

    def __init__(
        self,
        token: str,
        on_heartbeat: Callable[[Heartbeat], None],
        address: DriverAddress | None = None,
    ) -> None:
        if len(token) < 16:
            raise ValueError("the heartbeat token must have at least 16 characters (use secrets.token_hex())")
        address = address or DriverAddress()
        family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
        server_class = type("_BoundServer", (_Server,), {"address_family": family})
        self._server: _Server = server_class((address.host, address.port), _Handler)
        self._server.token, self._server.refused, self._server.latest = token, 0, {}
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
        return f"http://{host}:{self.port}"

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

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> HeartbeatServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def post(url: str, token: str, beat: Heartbeat, timeout: float) -> None:
    """Send one heartbeat; raises ``urllib.error.URLError``/``HTTPError`` when it is not accepted."""
    beat.sent = time.time()
    request = urllib.request.Request(
        f"{url}/heartbeat", data=json.dumps(asdict(beat)).encode(), method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=timeout) as response:
        response.read()


class HeartbeatSender:
    """The rank's end: a daemon thread that sends ``snapshot()`` every ``interval`` seconds.

    ``send_now`` sends synchronously (anomalies must reach the driver before the rank dies). Delivery
    failures are logged once and retried with the next beat: a rank never dies because the driver was
    briefly unreachable (the driver notices missing heartbeats instead).
    """

    def __init__(self, url: str, token: str, interval: float, snapshot: Callable[[], Heartbeat]) -> None:
        self.url, self._token, self.interval, self._snapshot = url, token, interval, snapshot
        self._stop = threading.Event()
        self._send_lock = threading.Lock()
        self._warned = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="megascale-ft-heartbeat")

    def start(self) -> None:
        self._thread.start()

    def send_now(self, beat: Heartbeat | None = None) -> bool:
        """Send one heartbeat (``snapshot()`` by default) now; True when the driver accepted it."""
        with self._send_lock:  # one request at a time keeps heartbeats in order
            try:
                post(self.url, self._token, beat or self._snapshot(), timeout=max(self.interval, 1.0))
                return True
            except (OSError, urllib.error.URLError) as e:
                if not self._warned:
                    log.warning(
                        "heartbeat to %s failed (%s); retrying every %.1f s", self.url, e, self.interval
                    )
                    self._warned = True
                return False

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.send_now()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval + 2)
