"""The driver of a multi-node run: one process that hears every rank and every node agent, attributes a fault
to a rank and a node, evicts bad nodes, takes spares, and restarts all nodes together.

Who does what. Each node runs ``megascale-ft launch --nnodes N --driver URL -- COMMAND`` (a `NodeAgent`); the
driver runs inside the first node's launcher (``launch`` without ``--driver``) or on its own
(``megascale-ft driver``). Every attempt is a fresh torchrun on each member node, meeting in torchrun's own
c10d rendezvous at a TCP store the driver hosts (so the rendezvous outlives any node: a node that hosted it
could not be evicted), under a run id of its own. The ranks' heartbeats go straight to the driver, as in a
one-machine launch; the agents add what only a node can see: which of its processes are gone, its
self-check verdict, its ranks' stacks.

An attempt: the live agents (members and spares) run their node's self-checks; a node that fails them is
evicted; the first ``nnodes`` healthy nodes in order of arrival run the attempt and the others wait as
spares. A fault ends the attempt on every node at once (the agents kill their trees), is attributed to a
node (the rank's node, or the node whose agent fell silent), and the next attempt starts from the latest
checkpoint. A node behind the same kind of fault ``evict_after`` times is evicted too. With fewer healthy
nodes than ``nnodes``, the driver waits up to ``node_timeout`` for spares (any agent that joins), then runs
on what it has if that is at least ``min_nodes`` (the data-parallel size shrinks; the training script
reshards its checkpoint and resumes its data elastically), and otherwise stops with a report that says so.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import logging
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from megascale.ft.executor import ENV
from megascale.ft.heartbeat import Heartbeat, HeartbeatServer
from megascale.ft.launcher import (
    POLL_S,
    STRAGGLER_CHECK_S,
    LaunchConfig,
    RunReport,
    failed_the_same_way,
    flag_stragglers,
    write_report,
)
from megascale.ft.monitor import Fault, JobMonitor

__all__ = ["ClusterConfig", "ClusterDriver"]

log = logging.getLogger("megascale.ft")

WAIT: dict[str, Any] = {"action": "wait"}
STOP_WAIT_S = 15.0  # how long the agents have to report their trees stopped
# faults after which the survivors fail by themselves at once (the failed rank's connections are closed: its
# process is gone, or it destroyed its process group), so agents restarting in place may keep their ranks; a
# hung rank keeps its connections open and its peers wait for it until the collective timeout
IN_PLACE_KINDS = ("dead", "exception", "nan", "exit")
STACKS_WAIT_S = 5.0  # how long the agents have to send their ranks' stacks


@dataclass
class ClusterConfig(LaunchConfig):
    """How the driver runs a multi-node job (`LaunchConfig`'s fields, ``nproc_per_node`` per node, plus:)

    Args:
        nnodes: nodes per attempt (more agents wait as spares).
        min_nodes: fewest nodes an attempt may run on when nodes were evicted and no spare came (default
            ``nnodes``: never shrink). The layout must allow it (data parallelism shrinks).
        node_timeout: seconds to wait for enough healthy nodes (at the start, and for spares).
        evict_after: a node behind the same kind of fault this many times is evicted.
        rdzv_endpoint: ``host:port`` where the driver hosts torchrun's rendezvous store (default: the
            heartbeat server's host, a free port). Nodes must reach it; like torchrun's, it has no token: it
            listens on that address only (not on every interface, as torch's own store would).
    """

    nnodes: int = 2
    min_nodes: int | None = None
    node_timeout: float = 300.0
    evict_after: int = 2
    rdzv_endpoint: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_nodes is None:
            self.min_nodes = self.nnodes
        if not 1 <= self.min_nodes <= self.nnodes:
            raise ValueError(f"need 1 <= min_nodes ({self.min_nodes}) <= nnodes ({self.nnodes})")
        if self.token is None:
            raise ValueError(
                "a multi-node run needs the token on every node: set MEGASCALE_FT_TOKEN (or --token-file) to "
                "the same secret on the driver and every node, e.g. from `python -c 'import secrets; "
                "print(secrets.token_hex(16))'`"
            )
        if self.evict_after < 1:
            raise ValueError(f"evict_after must be >= 1, got {self.evict_after}")
        if self.rdzv_endpoint is not None:
            host = self.rdzv_endpoint.rpartition(":")[0].strip("[]")
            try:
                everywhere = host == "" or ipaddress.ip_address(host).is_unspecified
            except ValueError:  # a host name
                everywhere = False
            if everywhere and not self.address.allow_any:
                raise ValueError(
                    f"refusing to bind the rendezvous store (no authentication) to every interface "
                    f"(--rdzv-endpoint {self.rdzv_endpoint}): give the cluster-internal address the nodes "
                    "reach the driver on"
                )


@dataclass
class _Agent:
    report: dict[str, Any]
    seen: float  # driver clock of the last report
    joined: int  # order of arrival


@dataclass
class _Verdict:
    """How the run ended, for the agents' last orders."""

    ok: bool
    acked: set[str] = field(default_factory=set)


class _Stores:
    """The driver's TCP stores: ``endpoint`` (torchrun's c10d rendezvous, for the whole run) and `fresh`
    ones, one per warm attempt, which every rank joins as a client (`megascale.ft.warm`)."""

    def __init__(self, process: subprocess.Popen[str], host: str, port: str) -> None:
        self._process, self._host = process, host
        self.endpoint = self._address(port)

    def _address(self, port: str) -> str:
        return f"[{self._host}]:{port}" if ":" in self._host else f"{self._host}:{port}"

    def fresh(self) -> str:
        """``host:port`` of a new, empty store on the same address (the two before it are kept: their
        attempt's ranks may still be leaving; older ones are closed)."""
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write("new\n")
        self._process.stdin.flush()
        line = self._process.stdout.readline().strip()
        if not line.isdigit():
            raise RuntimeError(
                f"the driver's store process could not open a store on {self._host} (see the log)"
            )
        return self._address(line)


@contextlib.contextmanager
def _rendezvous_store(endpoint: str | None, default_host: str) -> Iterator[_Stores]:
    """TCP stores for the rendezvous, in a child process for the whole run (torch is imported there, not in
    the driver): torchrun's c10d rendezvous store at ``endpoint``, and on request a fresh one per warm attempt.

    A store has no authentication, and torch's listens on every interface whatever host it is given: so
    each socket is bound here, to ``host`` only (loopback by default), and handed to the store."""
    host, _, port = (endpoint or f"{default_host}:0").rpartition(":")
    host = host.strip("[]")
    code = (
        "import socket, sys, torch.distributed as d\n"
        "def listen(host, port):\n"
        "    sock = socket.socket(socket.AF_INET6 if ':' in host else socket.AF_INET, socket.SOCK_STREAM)\n"
        "    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        "    sock.bind((host, port))\n    sock.listen(1024)\n"
        "    return sock, d.TCPStore(host, sock.getsockname()[1], is_master=True, multi_tenant=True,\n"
        "        wait_for_workers=False, master_listen_fd=sock.fileno(), use_libuv=True)\n"
        "host = sys.argv[1]\nkept = [listen(host, int(sys.argv[2]))]\n"
        "print(kept[0][1].port, flush=True)\n"
        "for line in sys.stdin:\n"
        "    kept.append(listen(host, 0))\n    del kept[1:-3]\n"
        "    print(kept[-1][1].port, flush=True)\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", code, host, port], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline().strip()
        if not line.isdigit():
            raise RuntimeError(f"the rendezvous store could not listen on {host}:{port} (see the log above)")
        yield _Stores(process, host, line)
    finally:
        process.kill()
        process.wait()


class ClusterDriver:
    """Drive a multi-node job: ``run()`` returns the `RunReport` (also ``run_dir/report.json``).

    ``url`` (the heartbeat server's) is set once ``ready`` is; agents on other nodes need it (``--driver``).
    """

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        assert config.token is not None and config.min_nodes is not None
        self.token, self.min_nodes = config.token, config.min_nodes
        self.run_dir = Path(config.run_dir)
        self.run_name = f"megascale-{secrets.token_hex(4)}"
        self.ready = threading.Event()
        self.url = ""
        self._lock = threading.Lock()
        self.agents: dict[str, _Agent] = {}
        self.orders: dict[str, dict[str, Any]] = {}
        self.evicted: dict[str, str] = {}
        self.faults: dict[str, list[str]] = {}  # node -> kinds of the faults attributed to it
        self.monitor: JobMonitor | None = None
        self.stragglers: dict[int, dict[str, Any]] = {}  # rank -> the attempt's straggler record
        self.verdict: _Verdict | None = None
        self._server: HeartbeatServer | None = None
        self._first_beat: float | None = None  # of the current attempt, for the recovery phases
        self._current = 0  # the attempt whose heartbeats count (an earlier one's ranks may still report)
        self._stepped: dict[int, float] = {}  # rank -> when it first reported a finished step
        self._duplicates: dict[tuple[str, Any, Any], float] = {}
        self._arrivals = itertools.count()
        # nodes whose warm spares' self-checks from before the next attempt are accepted (None: every node's,
        # before the first attempt); the previous attempt's members but the node its fault was blamed on
        self._trusted: set[str] | None = None
        self._stores: _Stores | None = None
        self._warm = False  # whether the current attempt runs in warm groups

    # --- the agents' side (server threads) ------------------------------------------------------------
    def _on_agent(self, report: dict[str, Any]) -> dict[str, Any]:
        node, now = str(report["node"]), time.time()
        with self._lock:
            if node in self.evicted:
                return {"action": "evicted", "reason": self.evicted[node]}
            known = self.agents.get(node)
            if known is not None and (known.report.get("host"), known.report.get("pid")) != (
                report.get("host"), report.get("pid")
            ) and now - known.seen < self.config.timeouts.hang_timeout:  # fmt: skip
                # a second agent under this name: a replacement waits until the old one is silent; two live
                # ones are a misconfiguration, said once
                if self._duplicates.setdefault((node, report.get("host"), report.get("pid")), now) == now:
                    log.warning("an agent on host %s also calls itself node %s; it waits until the other is "
                                "gone (give each node its own --node-rank)", report.get("host"), node)  # fmt: skip
                return dict(WAIT)
            if known is None or known.report.get("pid") != report.get("pid"):
                log.info("node %s joined (host %s)", node, report.get("host"))
            joined = next(self._arrivals) if known is None else known.joined
            self.agents[node] = _Agent(report, now, joined)
            if self.verdict is not None:
                self.verdict.acked.add(node)
                return {"action": "done", "ok": self.verdict.ok}
            return dict(self.orders.get(node, WAIT))

    def _on_heartbeat(self, beat: Heartbeat) -> None:
        if beat.attempt != self._current:
            # a rank of an earlier attempt still reporting (restarting in place, its ranks outlive the stop
            # and say how their run ended): not this attempt's news
            return
        if self.monitor is not None:
            self.monitor.on_heartbeat(beat)
        now = time.time()
        self._first_beat = self._first_beat or now
        if beat.step >= 0:
            self._stepped.setdefault(beat.rank, now)

    def _gone(self, beat: Heartbeat) -> bool:
        """The rank's node agent saw its process end."""
        with self._lock:
            agent = self.agents.get(beat.node or "")
            return agent is not None and beat.pid in agent.report.get("gone", ())

    def _snapshot(self) -> dict[str, _Agent]:
        with self._lock:
            return dict(self.agents)

    def _order(self, nodes: list[str], orders: dict[str, Any]) -> None:
        with self._lock:
            for node in nodes:
                self.orders[node] = dict(orders)

    def _evict(self, node: str, reason: str) -> None:
        log.error("evicting node %s: %s", node, reason)
        with self._lock:
            self.evicted[node] = reason
            self.orders.pop(node, None)

    def _live(self) -> list[str]:
        """Agents heard from within the hang timeout and not evicted, in order of arrival."""
        now, limit = time.time(), self.config.timeouts.hang_timeout
        agents = self._snapshot()
        live = [n for n, a in agents.items() if n not in self.evicted and now - a.seen < limit]
        return sorted(live, key=lambda n: agents[n].joined)

    # --- before an attempt: self-checks, eviction, spares -----------------------------------------------
    def _gather(self, attempt: int, entry: dict[str, Any]) -> list[str] | None:
        """The nodes of ``attempt``, or None when fewer than ``min_nodes`` healthy nodes came in time."""
        c = self.config
        deadline = time.time() + c.node_timeout
        checks: dict[str, dict[str, Any]] = {}
        quorum_at: float | None = None  # when enough nodes had passed their checks
        while True:
            live = self._live()
            if c.self_check:
                waiting = [n for n in live if n not in checks]
                for node in waiting:
                    # a warm spare's check from before the fault counts for the nodes the fault did not touch;
                    # the faulted node and nodes new to the run check again (`megascale.ft.warm`)
                    recheck = self._trusted is not None and node not in self._trusted
                    self._order([node], {"action": "check", "attempt": attempt, "timeout": c.self_check_timeout,
                                         "collective_timeout": c.timeouts.collective_timeout,
                                         "recheck": recheck})  # fmt: skip
                agents = self._snapshot()
                for node in waiting:
                    report = agents[node].report
                    if report.get("checked_attempt") == attempt and node not in checks:
                        checks[node] = report["self_check"]
                        if not checks[node]["ok"]:
                            self._evict(node, f"self-checks failed:\n{checks[node]['summary']}")
                healthy = [n for n in live if checks.get(n, {}).get("ok")]
                pending = [n for n in live if n not in checks]
            else:
                healthy, pending = live, []
            if len(healthy) >= c.nnodes:
                # the checks still running are waited for (a self-check timeout at most), so a node that
                # fails its check is evicted and named whatever the order in which the checks end
                quorum_at = quorum_at or time.time()
                if not pending or time.time() > quorum_at + c.self_check_timeout:
                    break
            elif time.time() > deadline and not pending:
                break
            if time.time() > deadline + c.self_check_timeout:
                break  # checks that never report: their nodes stay out
            time.sleep(POLL_S)
        if checks:
            entry["self_check"] = checks
        if len(healthy) < self.min_nodes:
            return None
        members = healthy[: c.nnodes]
        self._order([n for n in live if n not in members], WAIT)
        if len(members) < c.nnodes:
            log.warning("attempt %d runs on %d of %d nodes (no spare came within %.0f s)", attempt,
                        len(members), c.nnodes, c.node_timeout)  # fmt: skip
        return members

    # --- one attempt ------------------------------------------------------------------------------------
    def _run_orders(self, attempt: int, nnodes: int, endpoint: str) -> dict[str, Any]:
        t = self.config.timeouts
        env = {
            ENV["heartbeat_interval"]: t.heartbeat_interval, ENV["hang_timeout"]: t.hang_timeout,
            ENV["collective_timeout"]: t.collective_timeout,
        }  # fmt: skip
        return {"action": "run", "attempt": attempt, "nnodes": nnodes, "endpoint": endpoint,
                "run_id": f"{self.run_name}-{attempt}", "join_timeout": t.startup_timeout, "env": env}  # fmt: skip

    def _await_warm(self, members: list[str], attempt: int) -> bool:
        """Whether the attempt runs in warm groups: every member has them (reports ``warm``), and once their
        next groups are ready (``warm_ready``). The ranks of the nodes ready first would otherwise wait in
        init_process_group, within the collective timeout, for those still importing (torchrun's rendezvous
        waits for every node: so does this). False when a member has none, or loses them meanwhile, or within
        the startup timeout they never got ready (then torchrun), or a member was lost."""
        deadline = time.monotonic() + self.config.timeouts.startup_timeout
        while time.monotonic() < deadline:
            agents = self._snapshot()
            reports = [agents[n].report for n in members if n in agents]
            if len(reports) < len(members) or not all(r.get("warm") for r in reports):
                return False
            if all(r.get("warm_ready") for r in reports):
                return True
            if self._node_fault(members, attempt) is not None:
                return False
            time.sleep(POLL_S)
        log.warning(
            "attempt %d: warm groups not ready within the startup timeout; starting torchrun", attempt
        )
        return False

    def _node_fault(self, members: list[str], attempt: int, quiet_since: float | None = None) -> Fault | None:
        """A member whose agent fell silent (for the hang timeout, or since ``quiet_since``: when a peer's
        error is explained by a node that stopped reporting), or whose torchrun exited with an error no rank
        explained."""
        now, agents = time.time(), self._snapshot()
        for node in members:
            agent = agents[node]
            host = str(agent.report.get("host", "?"))
            silent = quiet_since is not None and agent.seen < quiet_since
            if silent or now - agent.seen > self.config.timeouts.hang_timeout:
                message = (
                    f"node {node}'s agent silent for {now - agent.seen:.1f} s (its machine or agent is gone)"
                )
                return Fault("node-lost", None, host, message, now, agent.seen, node=node)
        for node in members:
            report = agents[node].report
            if report.get("attempt") == attempt and report.get("state") == "exited" and report.get("code"):
                message = f"torchrun on node {node} exited with code {report['code']}; see that node's log"
                return Fault("exit", None, str(report.get("host", "?")), message, now, now, node=node)
        return None

    def _attempt(self, attempt: int, members: list[str], endpoint: str) -> Fault | None:
        c = self.config
        monitor = JobMonitor(len(members) * c.nproc_per_node, c.timeouts, gone=self._gone)
        self.monitor = monitor
        orders = self._run_orders(attempt, len(members), endpoint)
        warm = self._stores is not None and self._await_warm(members, attempt)
        self._warm = warm
        fault = self._node_fault(members, attempt)
        if fault is not None:  # a node was lost while the others were getting ready
            return fault
        if warm:
            # every node has a warm group: ranks by the order of the members, every rank a client of a store
            # of this attempt's own (no torchrun, no c10d rendezvous; `megascale.ft.warm`)
            assert self._stores is not None
            orders.update(mode="direct", master=self._stores.fresh())
            for rank, node in enumerate(members):
                self._order([node], {**orders, "node_rank": rank})
        else:
            self._order(members, orders)
        log.info("attempt %d on nodes %s (%d ranks%s)", attempt, ", ".join(members), monitor.world_size,
                 ", warm" if warm else "")  # fmt: skip
        flagged = self.stragglers = {}  # this attempt's, for report.json
        next_straggler_check = time.monotonic() + STRAGGLER_CHECK_S
        while True:
            if time.monotonic() > next_straggler_check:
                next_straggler_check += STRAGGLER_CHECK_S
                flag_stragglers(monitor, flagged, c.straggler_threshold)
            fault = monitor.check()
            if fault is not None and fault.kind == "exception":
                # a peer may be the cause: give the agents a few reports to say a process is gone (and stop
                # waiting as soon as one did)
                window = time.monotonic() + max(3 * POLL_S, 2 * c.timeouts.heartbeat_interval)
                while time.monotonic() < window:
                    time.sleep(POLL_S)
                    found = monitor.check()
                    if found is not None and found.kind != "exception":
                        break
                fault = monitor.check() or fault
                cause = self._node_fault(members, attempt, quiet_since=fault.detected)
                # a node that fell silent or a process gone explains a peer's error; a torchrun that exited
                # (code 1) does not: it is that error's own consequence
                if fault.kind == "exception" and cause is not None and cause.kind != "exit":
                    fault = cause
            fault = fault or self._node_fault(members, attempt)
            if fault is not None:
                if fault.kind == "hung":
                    fault = self._localise_hang(attempt, fault)
                return fault
            agents = self._snapshot()
            exited = [agents[n].report.get("attempt") == attempt and agents[n].report.get("state") == "exited"
                      for n in members]  # fmt: skip
            if monitor.finished() and all(exited):
                return None
            if all(exited):  # every torchrun ended with code 0, yet not every rank said "finished"
                time.sleep(POLL_S)
                if not monitor.finished():
                    message = "every node's torchrun exited, but not every rank reported finishing"
                    return Fault("exit", None, "?", message, time.time(), time.time())
            time.sleep(POLL_S)

    def _stop(self, attempt: int, members: list[str], keep: bool = False) -> None:
        """Every member's tree of ``attempt`` killed, or its agent silent, within `STOP_WAIT_S`; ``keep``:
        agents that restart in place may keep ranks that outlived the fault (`megascale.ft.agent`)."""
        self._order(members, {"action": "stop", "attempt": attempt, "keep": keep})
        deadline = time.monotonic() + STOP_WAIT_S
        while time.monotonic() < deadline:
            agents = self._snapshot()
            # carried out, not only ended: an attempt that exited by itself may leave processes (ranks kept
            # for a restart in place) that only the stop order settles
            if all(agents[n].report.get("stopped") == attempt or agents[n].report.get("attempt") != attempt
                   or time.time() - agents[n].seen > 3 * self.config.timeouts.heartbeat_interval
                   for n in members):  # fmt: skip
                break
            time.sleep(POLL_S)
        self._order(members, WAIT)

    def _localise_hang(self, attempt: int, fault: Fault) -> Fault:
        """Every rank's stacks through its node's agent, before the trees are killed."""
        from megascale.ft.hang_map import write_hang_map
        from megascale.ft.stacks import localise

        assert self.monitor is not None
        pids: dict[str, dict[str, int]] = {}
        for beat in self.monitor_beats():
            pids.setdefault(beat.node or "", {})[str(beat.rank)] = beat.pid
        for node, on_node in pids.items():
            self._order([node], {"action": "stacks", "attempt": attempt, "pids": on_node})
        stacks: dict[int, str] = {}
        sent: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + STACKS_WAIT_S
        while time.monotonic() < deadline:
            agents = self._snapshot()
            sent = {n: agents[n].report for n in pids if agents.get(n) and
                    agents[n].report.get("stacks_attempt") == attempt}  # fmt: skip
            if len(sent) == len(pids):
                break
            time.sleep(POLL_S)
        directory = self.run_dir / "stacks" / f"attempt-{attempt}"
        directory.mkdir(parents=True, exist_ok=True)
        for report in sent.values():
            for rank, text in report.get("stacks", {}).items():
                stacks[int(rank)] = text
                (directory / f"rank-{int(rank):05d}.txt").write_text(text)
        ranks = list(range(self.monitor.world_size))
        hang = localise(stacks, ranks, str(directory))
        log.error("hang: %s (stacks in %s)", hang.summary(), directory)
        write_hang_map(directory, self.monitor.coords, hang, ranks)
        return replace(fault, stacks=hang.to_json())

    def monitor_beats(self) -> list[Heartbeat]:
        return list(self._server.beats()) if self._server is not None else []

    # --- the run ----------------------------------------------------------------------------------------
    def _blame(self, fault: Fault) -> None:
        """Count the fault against its node; the same kind ``evict_after`` times evicts the node. A lost
        node's agent is forgotten: it (or its replacement) joins again as a new agent."""
        if fault.node is None:
            return
        if fault.kind == "node-lost":
            with self._lock:
                self.agents.pop(fault.node, None)
        kinds = self.faults.setdefault(fault.node, [])
        kinds.append(fault.kind)
        if kinds.count(fault.kind) >= self.config.evict_after:
            self._evict(
                fault.node, f"behind {kinds.count(fault.kind)} faults of kind {fault.kind!r} (last: {fault})"
            )

    def run(self) -> RunReport:
        c = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        report = RunReport(command=[])
        monitors: list[JobMonitor] = []
        signatures: list[tuple[str, int | None, str]] = []
        with (
            HeartbeatServer(
                self.token, self._on_heartbeat, c.address, tls=c.tls, on_agent=self._on_agent
            ) as server,
            _rendezvous_store(c.rdzv_endpoint, server.host) as stores,
        ):
            endpoint, self._stores = stores.endpoint, stores
            self._server, self.url = server, server.url
            log.info("driver: heartbeats on %s (token required), rendezvous store on %s; waiting for %d node(s)",
                     server.url, endpoint, c.nnodes)  # fmt: skip
            self.ready.set()
            for attempt in range(c.max_restarts + 1):
                started = time.time()
                entry: dict[str, Any] = {"attempt": attempt}
                members = self._gather(attempt, entry)
                gathered = time.time()
                if members is None:
                    entry["seconds"] = time.time() - started
                    report.attempts.append(entry)
                    report.reason = self._too_few(attempt)
                    break
                entry["nodes"] = members
                self._current = attempt
                server.forget()
                self._first_beat, self._stepped = None, {}
                fault = self._attempt(attempt, members, endpoint)
                stopping = time.time()
                entry.update(self._attempt_details(members))  # before the trees are stopped
                self._stop(attempt, members, keep=fault is not None and fault.kind in IN_PLACE_KINDS)
                entry["phases"] = self._phases(started, gathered, stopping, len(members) * c.nproc_per_node)
                if self.monitor is not None:
                    monitors.append(self.monitor)
                entry["seconds"] = time.time() - started
                entry["fault"] = None if fault is None else fault.to_json()
                entry["stragglers"] = sorted(self.stragglers.values(), key=lambda s: s["at"])
                report.attempts.append(entry)
                if fault is None:
                    report.ok = True
                    break
                log.error("attempt %d failed: %s", attempt, fault)
                self._blame(fault)
                self._trusted = set(members) - {fault.node} if fault.node is not None else set()
                reason = failed_the_same_way(signatures, fault, c.repeat_limit)
                if reason is not None:
                    report.reason = reason
                    break
            else:
                report.reason = f"gave up after {c.max_restarts} restarts (--max-restarts)"
            report.evicted = dict(self.evicted)
            report.connections = server.connections()
            self._finish(report.ok)
        write_report(self.run_dir, report, monitors, c.straggler_threshold)
        print(report.summary(), file=sys.stderr, flush=True)
        return report

    def _attempt_details(self, members: list[str]) -> dict[str, Any]:
        """For the report: whether the attempt ran in warm groups (and each node's: its supervisor, its
        workers, when they were ready), and every rank's pid."""
        details: dict[str, Any] = {
            "warm": self._warm, "ranks": {str(b.rank): b.pid for b in sorted(self.monitor_beats(), key=lambda b: b.rank)},
        }  # fmt: skip
        if self._warm:
            agents = self._snapshot()
            details["warm_groups"] = {n: agents[n].report.get("group") for n in members if n in agents}
        return details

    def _phases(
        self, started: float, gathered: float, stopping: float, world: int
    ) -> dict[str, float | None]:
        """Seconds of the attempt's phases: self-checks (and waiting for nodes), start (torchrun, rendezvous,
        imports, up to the first heartbeat), restore and first step (to every rank's first finished step),
        and stopping the trees after the attempt ended."""
        first = self._first_beat
        stepped = max(self._stepped.values()) if len(self._stepped) == world else None
        return {
            "self_check": gathered - started,
            "start": None if first is None else first - gathered,
            "restore_and_first_step": None if first is None or stepped is None else stepped - first,
            "stop": time.time() - stopping,
        }

    def _too_few(self, attempt: int) -> str:
        have = len([n for n in self._live() if n not in self.evicted])
        why = f"only {have} healthy node(s) for attempt {attempt}, fewer than min_nodes={self.min_nodes}"
        if self.evicted:
            why += "; evicted: " + "; ".join(
                f"node {n} ({r.splitlines()[0]})" for n, r in self.evicted.items()
            )
        return (f"{why}. Start a spare (`megascale-ft launch --nnodes ... --driver {self.url} -- COMMAND` on a "
                f"healthy machine) within --node-timeout, or allow fewer nodes (--nnodes MIN:MAX)")  # fmt: skip

    def _finish(self, ok: bool) -> None:
        """Tell every agent the run is over (it fetches that with its next report)."""
        with self._lock:
            self.verdict = _Verdict(ok)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            live = set(self._live())
            with self._lock:
                if live <= self.verdict.acked:
                    return
            time.sleep(POLL_S)
