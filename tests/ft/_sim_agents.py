"""Simulated nodes for megascale-ft at scale: many node agents and their ranks on one machine, as threads, talking
to a real `ClusterDriver` in its own process.

Each `SimNode` is what a machine of the job would be, minus torch ranks: an agent thread that reports with
`megascale.ft.heartbeat.exchange` every ``poll`` seconds and obeys the driver's orders (run, stacks, stop, done),
and, once ordered to run, a thread that meets the other nodes at the driver's rendezvous store (a barrier on the
store, one connection per node as torchrun holds; or torchrun's own c10d rendezvous, ``rendezvous="c10d"``) and
then sends each of its ranks'
heartbeats every ``interval`` seconds, each from a `megascale.ft.heartbeat.HeartbeatSender` thread of its own (the
sender every rank runs). Requests are signed, numbered and (with a certificate) over TLS exactly as a real node's:
only the processes behind them are missing.

`run_scenario` drives one measurement: N nodes reach a steady state, the driver's CPU and the heartbeats'
round trips are measured over a window, then one rank freezes (a hang) and, in the next attempt, one whole node
goes silent (its agent and ranks stop: the machine is gone); the driver's report says when it noticed each.

``python -m tests.ft._sim_agents CONFIG_JSON`` runs the driver (the child process `run_scenario` starts).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from megascale.ft import heartbeat
from megascale.ft.heartbeat import Heartbeat, HeartbeatSender, exchange

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "simulated-agents-token-0123456789"
FAKE_STACK = 'Thread 0x00007f0000000001 (most recent call first):\n  File "train.py", line {line} in {func}\n'


# Each simulated node connects from an address of its own (127.0.0.2, 127.0.0.3, ...: all of 127/8 is this
# machine), as nodes do: the server's per-address cap (`MAX_PER_PEER`, meant for one machine's agent and
# ranks) then applies per node, not to all of them at once. Set per thread; `post` and `exchange` (urllib,
# http.client) open their connections through `socket.create_connection`, which picks it up.
_SOURCE = threading.local()
_create_connection = socket.create_connection
_DEFAULT_TIMEOUT = getattr(socket, "_GLOBAL_DEFAULT_TIMEOUT")  # noqa: B009 - create_connection's own default


def _from_node_address(address: Any, timeout: Any = _DEFAULT_TIMEOUT, source_address: Any = None,
                       **kwargs: Any) -> socket.socket:  # fmt: skip
    source = getattr(_SOURCE, "address", None)
    if source_address is None and source is not None:
        source_address = (source, 0)
    return _create_connection(address, timeout, source_address, **kwargs)


def node_address(index: int) -> str:
    """The loopback address simulated node ``index`` connects from."""
    index += 2
    return f"127.{index >> 16 & 255}.{index >> 8 & 255}.{index & 255}"


@dataclass
class Stats:
    """What the simulated nodes saw: round trips (seconds) and failed requests, shared by every node."""

    beat_rtts: list[float] = field(default_factory=list)
    agent_rtts: list[float] = field(default_factory=list)
    beat_failures: int = 0
    agent_failures: int = 0
    timeouts: int = 0  # of the failures, those that only waited too long (a busy machine), not turned away
    errors: list[str] = field(default_factory=list)  # the first few failures' messages
    rendezvous_s: list[float] = field(default_factory=list)  # order to "run" -> rendezvous complete, per node
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, kind: str, seconds: float | None, error: BaseException | None = None) -> None:
        with self.lock:
            if error is None:
                assert seconds is not None
                (self.beat_rtts if kind == "beat" else self.agent_rtts).append(seconds)
                return
            if kind == "beat":
                self.beat_failures += 1
            else:
                self.agent_failures += 1
            reason = error.reason if isinstance(error, urllib.error.URLError) else error
            self.timeouts += isinstance(reason, TimeoutError)
            if len(self.errors) < 10:
                self.errors.append(f"{kind}: {error!r}")

    def reset_rtts(self) -> None:
        with self.lock:
            self.beat_rtts.clear()
            self.agent_rtts.clear()


class SimNode:
    """One simulated machine: a node agent and ``nproc`` ranks (see the module's docstring).

    ``freeze(local_rank)`` makes one rank stop beating (a rank stuck in a collective); ``kill()`` silences the
    whole node at once (its agent and ranks: the machine is gone).
    """

    def __init__(
        self, name: str, url: str, cafile: str | None, nproc: int, interval: float, poll: float, stats: Stats,
        rendezvous: str = "store", lockstep: bool = False, address: str | None = None,
    ) -> None:  # fmt: skip
        self.address = address  # the source address of its connections (None: the system's choice)
        self.name, self.url, self.cafile, self.nproc = name, url, cafile, nproc
        self.index = int(name) if name.isdigit() else 0  # its node rank without a rendezvous
        self.rendezvous, self.lockstep = rendezvous, lockstep
        self.interval, self.poll, self.stats = interval, poll, stats
        self.host = f"sim-{name}"
        self.attempt, self.state, self.code = -1, "idle", None
        self.ranks: dict[int, int] = {}  # global rank -> fake pid of this attempt (set by the rendezvous)
        self.beating = threading.Event()  # every rank of the current attempt sent a heartbeat
        self.sent: set[int] = set()  # local ranks that sent one
        self.stacks: dict[str, str] = {}
        self.stacks_attempt = -1
        self.frozen: set[int] = set()  # local ranks that stopped beating
        self.killed = threading.Event()
        self.exit_action: str | None = None
        self._ranks_stop = threading.Event()
        self._ranks_thread: threading.Thread | None = None
        self._handler: Any = None
        self._store: Any = None
        self._thread = threading.Thread(target=self._agent, daemon=True, name=f"sim-agent-{name}")

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def freeze(self, local_rank: int) -> None:
        self.frozen.add(local_rank)

    def kill(self) -> None:
        self.killed.set()
        self._ranks_stop.set()
        self._stop_keep_alive()

    # --- the agent --------------------------------------------------------------------------------------------
    def _report(self) -> dict[str, Any]:
        pids = sorted(self.ranks.values()) if self.state == "running" else []
        report: dict[str, Any] = {
            "node": self.name, "host": self.host, "pid": os.getpid(), "state": self.state, "attempt": self.attempt,
            "code": self.code, "alive": pids, "gone": [], "nproc_per_node": self.nproc,
            "stopped": self.attempt if self.state == "stopped" else -1,  # the stop order carried out
        }  # fmt: skip
        if self.stacks_attempt >= 0:
            report["stacks"], report["stacks_attempt"] = self.stacks, self.stacks_attempt
        return report

    def _agent(self) -> None:
        _SOURCE.address = self.address
        while not self.killed.is_set():
            started = time.perf_counter()
            try:
                orders = exchange(self.url, TOKEN, self._report(), timeout=10.0, cafile=self.cafile)
            except (OSError, urllib.error.URLError, ValueError) as e:
                self.stats.record("agent", None, e)
                time.sleep(self.poll)
                continue
            self.stats.record("agent", time.perf_counter() - started)
            if self.killed.is_set():
                return
            action, attempt = orders.get("action", "wait"), int(orders.get("attempt", -1))
            if action == "run" and attempt > self.attempt:
                self._run(orders)
            elif action == "stacks" and attempt == self.attempt and self.stacks_attempt != attempt:
                # what faulthandler would dump: the frozen rank stands out by its frame
                self.stacks = {
                    str(rank): FAKE_STACK.format(line=7 if local in self.frozen else 3,
                                                 func="wait" if local in self.frozen else "all_reduce")
                    for local, rank in enumerate(sorted(self.ranks)) if str(rank) in orders.get("pids", {})
                }  # fmt: skip
                self.stacks_attempt = attempt
            elif action == "stop" and attempt == self.attempt:
                self._stop_ranks()
                self.state = "stopped"
            elif action in ("done", "evicted"):
                self._stop_ranks()
                self.exit_action = action
                return
            time.sleep(self.poll)

    def _run(self, orders: dict[str, Any]) -> None:
        self._stop_ranks()
        self.attempt, self.state, self.code = int(orders["attempt"]), "running", None
        self.ranks, self.frozen, self.sent = {}, set(), set()
        self.beating.clear()
        self._ranks_stop = threading.Event()
        self._ranks_thread = threading.Thread(
            target=self._ranks, args=(orders, self._ranks_stop), daemon=True, name=f"sim-ranks-{self.name}"
        )
        self._ranks_thread.start()

    def _stop_ranks(self) -> None:
        self._ranks_stop.set()
        self._stop_keep_alive()
        if self._ranks_thread is not None and self._ranks_thread is not threading.current_thread():
            self._ranks_thread.join(timeout=2 * self.interval + 10)
        self._ranks_thread = None

    def _stop_keep_alive(self) -> None:
        self._store = None  # its connection closes with it
        handler, self._handler = self._handler, None
        if handler is not None:  # torchrun's rendezvous keep-alive thread; a killed node's stops with it
            handler._stop_heartbeats()

    # --- the ranks --------------------------------------------------------------------------------------------
    def _rendezvous(self, orders: dict[str, Any]) -> int:
        """This node's rank, from the driver's store: torchrun's own c10d rendezvous (``rendezvous="c10d"``),
        or a plain barrier on the store (``"store"``: one client connection per node, as torchrun holds, at
        a fraction of the CPU: 64 handlers' compare-and-set rounds in one process's threads take minutes on
        2 cores, which would measure this machine's GIL, not the store); ``"none"``: the node's index (no
        store: 64 clients connecting from one process's threads take ~5 s, too long for a fast test)."""
        nnodes = int(orders["nnodes"])
        started = time.perf_counter()
        if self.rendezvous == "none":
            return self.index
        if self.rendezvous == "store":
            from torch.distributed import TCPStore

            host, _, port = str(orders["endpoint"]).rpartition(":")
            timeout = timedelta(seconds=float(orders["join_timeout"]))
            store = TCPStore(host.strip("[]"), int(port), is_master=False, timeout=timeout, use_libuv=True)
            run_id = str(orders["run_id"])
            rank = int(store.add(f"{run_id}/joined", 1)) - 1
            if rank == nnodes - 1:
                store.set(f"{run_id}/complete", "1")
            store.wait([f"{run_id}/complete"], timeout)
            self._store = store
            with self.stats.lock:
                self.stats.rendezvous_s.append(time.perf_counter() - started)
            return rank
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

        params = RendezvousParameters(
            backend="c10d", endpoint=str(orders["endpoint"]), run_id=str(orders["run_id"]), min_nodes=nnodes,
            max_nodes=nnodes, is_host="false", join_timeout=str(int(float(orders["join_timeout"]))),
        )  # fmt: skip
        handler = get_rendezvous_handler(params)
        info = handler.next_rendezvous()
        self._handler = handler
        with self.stats.lock:
            self.stats.rendezvous_s.append(time.perf_counter() - started)
        return int(info.rank)

    def _ranks(self, orders: dict[str, Any], stop: threading.Event) -> None:
        try:
            node_rank = self._rendezvous(orders)
        except Exception as e:  # a failed rendezvous is a finding of the run, not a crash
            self.stats.record("beat", None, e)
            return
        attempt = int(orders["attempt"])
        first = node_rank * self.nproc
        # fake pids, unique per node and attempt: the driver only compares them with the agent's report
        self.ranks = {first + i: 1_000_000 + 1000 * node_rank + 100 * attempt + i for i in range(self.nproc)}
        senders: list[_SimSender] = []
        total = self.nproc * int(orders["nnodes"])
        for local, (rank, pid) in enumerate(self.ranks.items()):
            beat = Heartbeat(rank, self.host, pid, attempt, node=self.name, pid_started=None)
            # ranks start their timers spread over one interval (imports and restores end at different
            # times), or all at once (``lockstep``: the burst a synchronised restart sends)
            offset = 0.0 if self.lockstep else (rank / total) * self.interval
            senders.append(_SimSender(self, local, beat, offset))
        for sender in senders:
            sender.start()
        stop.wait()
        for sender in senders:
            sender.stop()


class _SimSender(HeartbeatSender):
    """One rank's heartbeats: the production sender (a thread per rank, `post` every ``interval``), timed, and
    silent while its rank is frozen."""

    def __init__(self, node: SimNode, local: int, beat: Heartbeat, offset: float) -> None:
        super().__init__(node.url, TOKEN, node.interval, self._snapshot, cafile=node.cafile)
        self.node, self.local, self.beat, self.offset = node, local, beat, offset

    def _snapshot(self) -> Heartbeat:
        self.beat.step += 1  # a step per heartbeat: progress, so only silence can look like a hang
        self.beat.progress = self.beat.step
        return replace(self.beat)

    def _run(self) -> None:
        _SOURCE.address = self.node.address
        if not self._stop.wait(self.offset):
            self.send_now()
            super()._run()

    def send_now(self, beat: Heartbeat | None = None) -> bool:
        if self.local in self.node.frozen or self.node.killed.is_set():
            return False
        # `HeartbeatSender.send_now`'s own work (one `post` under the lock), with the outcome kept, not logged
        with self._send_lock:
            started = time.perf_counter()
            try:
                heartbeat.post(self.url, TOKEN, beat or self._snapshot(), timeout=max(self.interval, 1.0),
                               cafile=self.cafile)  # fmt: skip
            except (OSError, urllib.error.URLError) as e:
                self.node.stats.record("beat", None, e)
                return False
        self.node.stats.record("beat", time.perf_counter() - started)
        self.node.sent.add(self.local)
        if len(self.node.sent) == self.node.nproc:
            self.node.beating.set()
        return True


# --- the driver, in a process of its own ------------------------------------------------------------------------
def driver_main(config: dict[str, Any]) -> None:
    """Run a `ClusterDriver` (``config``: `ClusterConfig`'s fields as JSON); print its URL once it listens."""
    import logging

    from megascale.ft.config import DriverAddress, Timeouts, TLSConfig
    from megascale.ft.driver import ClusterConfig, ClusterDriver

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    tls = config.pop("tls", None)
    timeouts = Timeouts(**config.pop("timeouts"))
    cluster = ClusterConfig(
        **config, timeouts=timeouts, address=DriverAddress(), token=TOKEN,
        tls=None if tls is None else TLSConfig(*tls), self_check=False,
    )  # fmt: skip
    driver = ClusterDriver(cluster)
    runner = threading.Thread(target=driver.run, name="driver")
    runner.start()
    driver.ready.wait()
    print(driver.url, flush=True)
    runner.join()
    server = driver._server
    assert server is not None
    print(json.dumps({"refused": server.refused, "turned_away": server.turned_away}), flush=True)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (the driver's rendezvous store)."""
    found: list[int] = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of ``values``; NaN when there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def _steady(sims: list[SimNode], attempt: int, timeout: float) -> int:
    """The attempt (``attempt`` or a later one) in which every live node's ranks are beating, once they are."""
    live = lambda: [s for s in sims if not s.killed.is_set()]  # noqa: E731
    _wait(lambda: len({s.attempt for s in live()}) == 1 and all(s.beating.is_set() for s in live())
          and live()[0].attempt >= attempt, timeout, f"every rank of attempt {attempt} or later beating")  # fmt: skip
    return live()[0].attempt


def _wait(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.05)


def run_scenario(
    nodes: int,
    run_dir: Path,
    *,
    nproc: int = 8,
    interval: float = 5.0,
    poll: float = 0.25,
    hang_timeout: float = 10.0,
    window: float = 15.0,
    tls: tuple[str, str] | None = None,
    faults: tuple[str, ...] = ("hang", "node"),
    rendezvous: str = "store",
    lockstep: bool = False,
    shared_address: bool = False,
) -> dict[str, Any]:
    """Measure one size (see the module's docstring); the numbers as a dict.

    ``faults``: "hang" (one rank stops beating) and/or "node" (in the next attempt, one node's agent and
    ranks stop). With "node", the driver finds too few nodes for the next attempt (no spare within its
    node_timeout) and ends the run; with "hang" alone, it gives up after it (no restart). Any other fault,
    in whatever attempt, counts as a false one.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    timeouts = {"heartbeat_interval": interval, "hang_timeout": hang_timeout,
                "collective_timeout": 2 * hang_timeout, "startup_timeout": max(60.0, hang_timeout)}  # fmt: skip
    config = {"nnodes": nodes, "nproc_per_node": nproc, "max_restarts": 3 if "node" in faults else 0,
              "node_timeout": 15.0, "run_dir": str(run_dir / "driver"), "timeouts": timeouts,
              "tls": list(tls) if tls else None}  # fmt: skip
    # once here, before the driver waits node_timeout for the nodes: not by 64 threads at once in the rendezvous
    if rendezvous != "none":
        import torch.distributed  # noqa: F401

    log_path = run_dir / "driver.log"
    with log_path.open("w") as log_file:
        driver = subprocess.Popen(
            [sys.executable, "-m", "tests.ft._sim_agents", json.dumps(config)], cwd=ROOT,
            stdout=subprocess.PIPE, stderr=log_file, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
    assert driver.stdout is not None
    url = driver.stdout.readline().strip()
    if not url:
        driver.wait(10)
        raise RuntimeError(f"the driver did not start:\n{log_path.read_text()[-3000:]}")
    stats = Stats()
    cafile = tls[0] if tls else None
    sims = [SimNode(str(i), url, cafile, nproc, interval, poll, stats, rendezvous, lockstep,
                    None if shared_address else node_address(i)) for i in range(nodes)]  # fmt: skip
    socket.create_connection = _from_node_address  # type: ignore[assignment]
    result: dict[str, Any] = {"nodes": nodes, "ranks": nodes * nproc, "interval": interval, "poll": poll,
                              "hang_timeout": hang_timeout, "tls": tls is not None}  # fmt: skip
    client0 = time.process_time()
    started = time.monotonic()
    try:
        for sim in sims:
            sim.start()
        _steady(sims, 0, 120 + 2 * interval)  # 64 TLS agents joining a machine at load average 40 took > 70 s
        result["startup_s"] = time.monotonic() - started
        result["rendezvous_p50_s"] = percentile(stats.rendezvous_s, 50)
        time.sleep(interval)  # one more beat of every rank: steady state
        stats.reset_rtts()
        store = children(driver.pid)
        cpu0, store0, wall0 = cpu_seconds(driver.pid), sum(map(cpu_seconds, store)), time.monotonic()
        client_cpu0 = time.process_time()
        load0 = os.getloadavg()[0]
        time.sleep(window)
        wall = time.monotonic() - wall0
        result["driver_cpu"] = (cpu_seconds(driver.pid) - cpu0) / wall
        result["store_cpu"] = (sum(map(cpu_seconds, store)) - store0) / wall
        result["sim_cpu"] = (time.process_time() - client_cpu0) / wall
        result["load"] = (load0 + os.getloadavg()[0]) / 2
        with stats.lock:
            beats, agents = list(stats.beat_rtts), list(stats.agent_rtts)
        result["beats_per_s"], result["reports_per_s"] = len(beats) / wall, len(agents) / wall
        for kind, rtts in (("beat", beats), ("agent", agents)):
            for q in (50, 99):
                result[f"{kind}_p{q}_ms"] = percentile(rtts, q) * 1e3
        # attempt -> ("rank", global rank) or ("node", name): the fault caused in it (an attempt may have
        # ended on a false fault meanwhile: the next fault goes into the attempt running then)
        expected: dict[int, tuple[str, Any]] = {}
        attempt = 0
        if "hang" in faults:
            attempt = _steady(sims, attempt, 4 * hang_timeout + 60)
            victim, local = sims[nodes // 2], nproc // 2
            expected[attempt] = ("rank", sorted(victim.ranks)[local])
            result["hang_at"] = time.time()
            victim.freeze(local)
            attempt += 1
        if "node" in faults:
            attempt = _steady(sims, attempt, 4 * hang_timeout + 60)
            dead = sims[-1] if nodes > 1 else sims[0]
            expected[attempt] = ("node", dead.name)
            result["node_at"] = time.time()
            dead.kill()
        driver.wait(timeout=4 * hang_timeout + 90)
    finally:
        for sim in sims:
            sim.kill()
        socket.create_connection = _create_connection
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    result["sim_cpu_total"] = (time.process_time() - client0) / (time.monotonic() - started)
    report = json.loads((run_dir / "driver" / "report.json").read_text())
    log_text = log_path.read_text()
    counts = json.loads(driver.stdout.readline() or "{}")  # the server's own counts, printed at its end
    result["refused"] = counts.get("refused", log_text.count("heartbeat server: refused"))
    result["turned_away"] = counts.get("turned_away", log_text.count("connection(s) turned away"))
    result["beat_failures"], result["agent_failures"] = stats.beat_failures, stats.agent_failures
    result["timeouts"] = stats.timeouts
    result["errors"] = stats.errors
    false_faults = 0
    for entry in report["attempts"]:
        fault = entry.get("fault")
        if fault is None:
            continue
        kind, what = expected.get(entry["attempt"], ("", None))
        named = fault.get("rank") == what if kind == "rank" else kind == "node" and fault.get("node") == what
        if not named:
            false_faults += 1
            continue
        at = result["hang_at"] if kind == "rank" else result["node_at"]
        key = "hang" if kind == "rank" else "node"
        result[f"{key}_detect_s"] = fault["detected"] - at  # from the fault to the driver's verdict
        # past the timeout: how late the driver was (its loop, its load), the part that could grow with N
        result[f"{key}_overshoot_s"] = fault["detected"] - fault["since"] - hang_timeout
        result[f"{key}_fault"] = f"{fault['kind']} rank {fault['rank']} node {fault['node']}"
    result["false_faults"] = false_faults
    result["attempts"] = [a.get("fault") and {k: a["fault"][k] for k in ("kind", "rank", "node", "message")}
                          for a in report["attempts"]]  # fmt: skip
    return result


if __name__ == "__main__":
    driver_main(json.loads(sys.argv[1]))


def self_signed_certificate(directory: Path) -> tuple[str, str]:
    """(cert, key) paths of a self-signed RSA-2048 certificate for 127.0.0.1 (what tests/ft, this harness and the
    guide's examples use), written into ``directory`` by openssl."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return str(cert), str(key)
