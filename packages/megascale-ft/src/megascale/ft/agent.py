"""One node's agent in a multi-node run: it reports to the driver and does what the driver orders.

``megascale-ft launch --nnodes N --driver URL -- train.py ...`` on every node starts a `NodeAgent`. It
reports (``POST /agent``, signed and numbered like the ranks' heartbeats) every ``poll`` seconds: its state in
the current attempt, the pids of the processes it started that are alive and those that are gone (so the
driver can tell "rank 5's process is gone" on another machine), and the results of what it was asked to do.
The driver answers with orders (`megascale.ft.driver`):

- ``wait``: nothing to do (a spare, or between attempts);
- ``check``: run this node's self-checks (under a node-local torchrun) and report the verdict;
- ``run``: start torchrun for attempt k as one node of a c10d rendezvous of ``nnodes`` nodes at the
  driver's store, with the heartbeat settings in the ranks' environment;
- ``stacks``: dump the stacks of the ranks given (hang localisation) and send them;
- ``stop``: kill this node's process tree of attempt k (SIGKILL; checkpoints are on storage);
- ``evicted`` / ``done``: stop and exit.

The training command is the agent's own (each node gives it on its command line, as with torchrun): the
driver never sends code to run. An agent that cannot reach its driver for ``driver_timeout`` seconds stops
its processes and exits, so a lost driver leaves nothing training unsupervised.
"""

from __future__ import annotations

import logging
import os
import shlex
import socket
import subprocess
import threading
import time
import urllib.error
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megascale.ft._procs import descendants, kill_tree, pid_alive, same_process, start_time
from megascale.ft.executor import ENV
from megascale.ft.heartbeat import exchange
from megascale.ft.launcher import Rendezvous, _torchrun, run_self_check
from megascale.ft.stacks import STACKS_ENV, collect_stacks, prune_empty

__all__ = ["AgentConfig", "NodeAgent"]

log = logging.getLogger("megascale.ft")


@dataclass
class AgentConfig:
    """How a node's agent runs.

    Args:
        node: this node's name in reports (``--node-rank``; default the host name). Unique per node.
        driver_url: the driver's heartbeat server (``https://host:port`` across machines).
        token: the job's shared secret (the same on the driver and every node).
        nproc_per_node: ranks on this node.
        run_dir: self-check reports and the ranks' stack dumps of this node.
        storage: checkpoint storage URL the self-checks probe.
        cafile: what an ``https`` driver's certificate is verified against.
        poll: seconds between two reports.
        driver_timeout: give up (stop the processes, exit) when the driver was unreachable this long.
    """

    node: str
    driver_url: str
    token: str
    nproc_per_node: int = 1
    run_dir: str = "megascale-ft-run"
    storage: str | None = None
    cafile: str | None = None
    poll: float = 0.25
    driver_timeout: float = 120.0


class NodeAgent:
    """Runs ``command`` on this node whenever the driver orders an attempt; ``run()`` returns the exit code
    (0: the job finished, 1: it failed, 3: this node was evicted, 4: the driver was lost)."""

    def __init__(self, command: list[str], config: AgentConfig) -> None:
        self.command, self.config = list(command), config
        self.run_dir = Path(config.run_dir)
        self.process: subprocess.Popen[bytes] | None = None
        self.attempt = -1
        self.state = "idle"
        self.code: int | None = None
        # every process seen under this attempt's torchrun -> its start time: a pid that ended may be reused
        # by another process of the machine, which must be neither reported alive nor killed
        self.known: dict[int, int] = {}
        self.check: dict[str, Any] | None = None  # the self-check verdict, for ``checked_attempt``
        self.checked_attempt = -1
        self.stacks: dict[str, str] = {}
        self.stacks_attempt = -1
        self._checking: threading.Thread | None = None

    # --- reports ----------------------------------------------------------------------------------
    def _report(self) -> dict[str, Any]:
        if self.process is not None:
            for pid in [self.process.pid, *descendants(self.process.pid)]:
                started = start_time(pid) if pid not in self.known else None
                if started is not None:
                    self.known[pid] = started
        alive = sorted(p for p, t in self.known.items() if same_process(p, t) and pid_alive(p))
        report: dict[str, Any] = {
            "node": self.config.node, "host": socket.gethostname(), "pid": os.getpid(), "state": self.state,
            "attempt": self.attempt, "code": self.code, "alive": alive,
            "gone": sorted(set(self.known).difference(alive)), "nproc_per_node": self.config.nproc_per_node,
        }  # fmt: skip
        if self.check is not None:
            report["self_check"], report["checked_attempt"] = self.check, self.checked_attempt
        if self.stacks_attempt >= 0:
            report["stacks"], report["stacks_attempt"] = self.stacks, self.stacks_attempt
        return report

    # --- orders -----------------------------------------------------------------------------------
    def _self_check(self, attempt: int, collective_timeout: float, timeout: float) -> None:
        directory = self.run_dir / f"node-{self.config.node}"
        directory.mkdir(parents=True, exist_ok=True)
        result = run_self_check(
            self.config.nproc_per_node, directory / f"selfcheck-{attempt}.json", timeout, collective_timeout,
            self.config.storage,
        )  # fmt: skip
        self.check, self.checked_attempt = result, attempt

    def _start(self, orders: dict[str, Any]) -> None:
        attempt = int(orders["attempt"])
        rendezvous = Rendezvous(
            int(orders["nnodes"]),
            str(orders["endpoint"]),
            str(orders["run_id"]),
            float(orders["join_timeout"]),
        )
        env = dict(os.environ)
        env.update({str(k): str(v) for k, v in orders["env"].items() if str(k).startswith("MEGASCALE_FT_")})
        env.update({
            ENV["url"]: self.config.driver_url, ENV["token"]: self.config.token, ENV["attempt"]: str(attempt),
            ENV["node"]: self.config.node, STACKS_ENV: str(self._stacks_dir(attempt)),
            # each attempt's workers get a store of their own, not the long-lived rendezvous store (whose
            # keys the previous attempt's gloo groups left behind: shared notes)
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        })  # fmt: skip
        if self.config.storage:
            env["MEGASCALE_FT_STORAGE"] = self.config.storage
        if self.config.cafile:
            env[ENV["cafile"]] = self.config.cafile
        command = _torchrun(self.config.nproc_per_node, self.command, rendezvous)
        log.info("node %s, attempt %d: %s", self.config.node, attempt, shlex.join(command))
        self.known, self.code, self.attempt, self.state = {}, None, attempt, "running"
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True)

    def _stacks_dir(self, attempt: int) -> Path:
        return self.run_dir / f"node-{self.config.node}" / "stacks" / f"attempt-{attempt}"

    def _collect_stacks(self, attempt: int, pids: dict[str, int]) -> None:
        # only this node's processes of the attempt (SIGUSR1 would end a stranger that reused a rank's pid)
        ours = {int(r): int(p) for r, p in pids.items() if same_process(int(p), self.known.get(int(p), -1))}
        found = collect_stacks(ours, self._stacks_dir(attempt))
        self.stacks, self.stacks_attempt = {str(r): text for r, text in found.items()}, attempt

    def _stop(self) -> None:
        if self.process is not None:
            kill_tree(self.process.pid, extra=self.known)
            self.process.wait()
            self.process = None
            prune_empty(self._stacks_dir(self.attempt))
            if self.state == "running":
                self.state = "stopped"

    def _obey(self, orders: dict[str, Any]) -> int | None:
        action = orders.get("action", "wait")
        attempt = int(orders.get("attempt", -1))
        if action == "check" and self.checked_attempt != attempt and self._checking is None:
            self.state = "checking"
            self._checking = threading.Thread(
                target=self._self_check, daemon=True, name="megascale-ft-selfcheck",
                args=(attempt, float(orders["collective_timeout"]), float(orders["timeout"])),
            )  # fmt: skip
            self._checking.start()
        elif action == "run" and attempt > self.attempt:
            self._start(orders)
        elif action == "stacks" and attempt == self.attempt and self.stacks_attempt != attempt:
            self._collect_stacks(attempt, orders.get("pids", {}))
        elif action == "stop" and attempt == self.attempt:
            self._stop()
        elif action in ("evicted", "done"):
            self._stop()
            if action == "evicted":
                log.error("node %s evicted by the driver: %s", self.config.node, orders.get("reason", ""))
                return 3
            return 0 if orders.get("ok") else 1
        return None

    def _tick(self) -> None:
        if self._checking is not None and not self._checking.is_alive():
            self._checking, self.state = None, "checked"
        if self.process is not None and self.state == "running":
            code = self.process.poll()
            if code is not None:
                self.code, self.state = code, "exited"

    def run(self) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        last_contact = time.monotonic()
        warned = False
        try:
            while True:
                self._tick()
                try:
                    orders = exchange(
                        self.config.driver_url, self.config.token, self._report(), timeout=10.0,
                        cafile=self.config.cafile,
                    )  # fmt: skip
                    last_contact, warned = time.monotonic(), False
                except (OSError, urllib.error.URLError, ValueError) as e:
                    if not warned:
                        log.warning("node %s: driver %s unreachable (%s); retrying", self.config.node,
                                    self.config.driver_url, e)  # fmt: skip
                        warned = True
                    if time.monotonic() - last_contact > self.config.driver_timeout:
                        log.error("node %s: no driver for %.0f s; stopping", self.config.node,
                                  self.config.driver_timeout)  # fmt: skip
                        return 4
                    time.sleep(self.config.poll)
                    continue
                code = self._obey(orders)
                if code is not None:
                    return code
                time.sleep(self.config.poll)
        finally:
            self._stop()
