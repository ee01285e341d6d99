"""One node's agent in a multi-node run: it reports to the driver and does what the driver orders.

``megascale-ft launch --nnodes N --driver URL -- train.py ...`` on every node starts a `NodeAgent`. It
reports (``POST /agent``, signed and numbered like the ranks' heartbeats) every ``poll`` seconds: its state in
the current attempt, the pids of the processes it started that are alive and those that are gone (so the
driver can tell "rank 5's process is gone" on another machine), and the results of what it was asked to do.
The driver answers with orders (`megascale.ft.driver`):

- ``wait``: nothing to do (a spare, or between attempts);
- ``check``: run this node's self-checks (under a node-local torchrun, or in a warm group) and report the
  verdict; ``recheck: false`` accepts the check a warm spare ran ahead, before the fault;
- ``run``: start attempt k with the heartbeat settings in the ranks' environment: torchrun as one node of a
  c10d rendezvous of ``nnodes`` nodes at the driver's store or, ``mode: direct``, the next warm group with
  the ranks the driver assigned (node ``node_rank``, every rank a client of the attempt's store ``master``);
- ``stacks``: dump the stacks of the ranks given (hang localisation) and send them;
- ``stop``: kill this node's process tree of attempt k (SIGKILL; checkpoints are on storage); ``keep``:
  restarting in place (``in_place``), keep the ranks if they all settle (`megascale.ft.warm`);
- ``evicted`` / ``done``: stop and exit.

Warm spares (`megascale.ft.warm`, on unless ``warm=False``): the agent keeps ``warm_spares`` warm groups
waiting beyond the one running (one process per local rank, torch and the script's imports loaded, checked
ahead), and refills the pool a little after handing one out (`REFILL_DELAY_S`), so a restart starts no
process. It reports ``warm: true``; the driver runs an attempt in warm groups when every node of it does.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megascale.ft._procs import descendants, kill_tree, pid_alive, same_process, start_time
from megascale.ft.executor import ENV
from megascale.ft.heartbeat import exchange
from megascale.ft.launcher import Rendezvous, _torchrun, run_self_check
from megascale.ft.stacks import STACKS_ENV, collect_stacks, prune_empty
from megascale.ft.warm import WarmGroup, rank_env

__all__ = ["AgentConfig", "NodeAgent"]

log = logging.getLogger("megascale.ft")

# a new spare imports torch: not while the attempt that just took one restores and takes its first steps,
# which it would slow down on a node whose cores are all busy (a fault in these seconds starts a fresh group)
REFILL_DELAY_S = 5.0
# warm groups that may be lost in a row; then a pending check fails, and the node goes on without warm spares
WARM_GROUP_RETRIES = 2
# in place: after the driver's stop, how long the attempt's ranks have to fail by themselves and settle (their
# failed peer's connections closed: they fail at once, then run the script's error handling) before the tree
# is killed as without in place
IN_PLACE_WAIT_S = 20.0
# in place: how long the next attempt's start may wait for them once ordered (the agent goes on reporting, the
# other nodes' ranks wait in init_process_group); a group not settled by then is killed, a spare runs it
IN_PLACE_START_WAIT_S = 10.0


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
        warm: keep warm spares (`megascale.ft.warm`); off: every attempt is a fresh torchrun.
        warm_spares: warm groups waiting while an attempt runs (one more before the first attempt).
        warm_imports: modules the spares import ahead besides torch and the script's top-level imports.
        self_check: whether a spare runs the self-checks ahead (the driver's ``--no-self-check`` off).
        check_timeout: seconds a spare's self-checks may take.
        in_place: when an attempt fails and every rank of this node is still alive (an exception here, or a
            peer's fault elsewhere), the next attempt runs in the same processes (`megascale.ft.warm`): no
            process starts, the script runs again as ``__main__``. Needs ``warm``.
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
    warm: bool = True
    warm_spares: int = 1
    warm_imports: list[str] = field(default_factory=list)
    self_check: bool = True
    check_timeout: float = 60.0
    in_place: bool = False

    def __post_init__(self) -> None:
        if self.warm_spares < 0:
            raise ValueError(f"warm_spares must be >= 0, got {self.warm_spares}")
        if self.in_place and not self.warm:
            raise ValueError("restarting in place needs warm groups: drop --no-warm or --restart-in-place")


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
        self.pool: list[WarmGroup] = []  # warm groups waiting, oldest (the next attempt's) first
        self.group: WarmGroup | None = None  # the warm group running the attempt
        self.kept: WarmGroup | None = None  # in place: the failed attempt's group, its ranks waiting
        self._keeping: float | None = None  # in place: stop ordered; the deadline for the ranks to settle
        self.stopped = (
            -1
        )  # the last attempt whose stop order this agent carried out (the driver waits for it)
        self._prechecks: dict[WarmGroup, int] = {}  # a spare's check run ahead -> its id
        self._pending_check: tuple[int, WarmGroup, int, bool] | None = None  # attempt, group, id, ran ahead
        self._group_failures = 0  # warm groups lost in a row
        self._handed_out: float | None = None  # monotonic time a group last started an attempt
        self._groups = 0
        self._wake = threading.Event()  # a warm group's verdict came: report it now, not a poll later
        self.warm = config.warm  # off after warm groups kept dying: then torchrun, as without them

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
            "attempt": self.attempt, "code": self.code, "alive": alive, "stopped": self.stopped,
            "gone": sorted(set(self.known).difference(alive)), "nproc_per_node": self.config.nproc_per_node,
            "warm": self.warm, "spares": sum(g.ready.is_set() for g in self.pool),
            # the next attempt's group is ready: the driver starts a warm attempt when every node says so
            "warm_ready": self.warm and not self._warming() and bool(self.pool) and self.pool[0].ready.is_set(),
        }  # fmt: skip
        if self.group is not None:
            report["group"] = {"name": self.group.name, "pid": self.group.pid, "workers": self.group.workers,
                               "ready_at": self.group.info.get("at"), "runs": self.group.runs,
                               "in_place": self.group.runs > 1}  # fmt: skip
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

    def _env(self, orders: dict[str, Any]) -> dict[str, str]:
        """The attempt's environment for the ranks (the agent's, plus what the driver and this node add)."""
        attempt = int(orders["attempt"])
        env = dict(os.environ)
        env.update({str(k): str(v) for k, v in orders["env"].items() if str(k).startswith("MEGASCALE_FT_")})
        env.update({
            ENV["url"]: self.config.driver_url, ENV["token"]: self.config.token, ENV["attempt"]: str(attempt),
            ENV["node"]: self.config.node, STACKS_ENV: str(self._stacks_dir(attempt)),
            # the ranks' store is the one node 0's torchrun agent binds on port 0 once the rendezvous is
            # done (torch >= 2.6: a new one per torchrun, i.e. per attempt). Without sharing, rank 0 binds a
            # port torch chose earlier by binding port 0 and closing it: in that window any outgoing
            # connection may take it (EADDRINUSE, a failed attempt)
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0",
        })  # fmt: skip
        if self.config.storage:
            env["MEGASCALE_FT_STORAGE"] = self.config.storage
        if self.config.cafile:
            env[ENV["cafile"]] = self.config.cafile
        if self.config.nproc_per_node > 1 and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = "1"  # as torchrun sets it: ranks sharing a node's cores
        return env

    def _start(self, orders: dict[str, Any]) -> None:
        attempt = int(orders["attempt"])
        if orders.get("mode") != "direct" and self.kept is not None:  # torchrun: nothing runs in place
            self.kept.close()
            self.kept = None
        env = self._env(orders)
        self.known, self.code, self.attempt, self.state = {}, None, attempt, "running"
        if orders.get("mode") == "direct":
            self._start_warm(orders, env)
            return
        rendezvous = Rendezvous(
            int(orders["nnodes"]),
            str(orders["endpoint"]),
            str(orders["run_id"]),
            float(orders["join_timeout"]),
        )
        command = _torchrun(self.config.nproc_per_node, self.command, rendezvous)
        log.info("node %s, attempt %d: %s", self.config.node, attempt, shlex.join(command))
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True)

    # --- warm spares ------------------------------------------------------------------------------
    def _new_group(self) -> WarmGroup:
        env = dict(os.environ)
        if self.config.nproc_per_node > 1 and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = "1"  # read when torch is imported: before the attempt's env exists
        self._groups += 1
        name = f"warm-{self.config.node}-{self._groups}"
        group = WarmGroup(self.command, self.config.nproc_per_node, env, self.config.warm_imports, name=name,
                          on_event=self._wake.set, in_place=self.config.in_place)  # fmt: skip
        log.debug("node %s: warm group %s started (pid %d)", self.config.node, name, group.pid)
        return group

    def _next_group(self) -> WarmGroup:
        """The group the next attempt (or check) uses: the oldest in the pool, a new one if none is left."""
        if not self.pool:
            self.pool.append(self._new_group())
        return self.pool[0]

    def _discard(self, group: WarmGroup) -> None:
        if group in self.pool:
            self.pool.remove(group)
        self._prechecks.pop(group, None)
        group.close()

    def _check_path(self, label: str) -> Path:
        directory = self.run_dir / f"node-{self.config.node}"
        directory.mkdir(parents=True, exist_ok=True)
        return directory / f"selfcheck-{label}.json"

    def _tend_pool(self) -> None:
        """Drop lost groups, start the next one when the pool is short (one import at a time), and have
        ready spares check themselves ahead."""
        for group in [g for g in self.pool if not g.alive()]:
            log.warning("node %s: warm group %s exited while waiting (code %s); replacing it",
                        self.config.node, group.name, group.process.returncode)  # fmt: skip
            self._discard(group)
            self._group_failures += 1
        if self._group_failures > WARM_GROUP_RETRIES:
            log.error("node %s: %d warm groups in a row were lost (see the log above); this node goes on without "
                      "warm spares (every attempt a fresh torchrun)", self.config.node, self._group_failures)  # fmt: skip
            self.warm = False
            for group in list(self.pool):
                self._discard(group)
            return
        if any(g.ready.is_set() for g in self.pool):
            self._group_failures = 0
        if self.attempt < 0:  # the first attempt's group and the spares, all at once
            while len(self.pool) < self.config.warm_spares + 1:
                self.pool.append(self._new_group())
        else:  # one at a time; while the attempt that took one runs, a little later (`REFILL_DELAY_S`)
            running = self.state == "running"
            importing = any(not g.ready.is_set() for g in self.pool)
            delayed = (
                running
                and self._handed_out is not None
                and time.monotonic() < self._handed_out + REFILL_DELAY_S
            )
            need = self.config.warm_spares if running else max(1, self.config.warm_spares)
            if len(self.pool) < need and not importing and not delayed:
                self.pool.append(self._new_group())
        if self.config.self_check:
            for group in self.pool:
                if group.ready.is_set() and group not in self._prechecks:
                    path = self._check_path(f"spare-{group.name.rpartition('-')[2]}")
                    self._prechecks[group] = group.check(path, self.config.check_timeout, self.config.storage)

    def _warming(self) -> bool:
        """Before the first attempt: not every group of the pool is ready and checked yet. The first attempt
        waits for them, so that a fault at any time finds a spare in place (on a node with many cores the
        groups import side by side: the wait is short)."""
        if not self.warm or self.attempt >= 0:
            return False
        if len(self.pool) < self.config.warm_spares + 1 or not all(g.ready.is_set() for g in self.pool):
            return True
        checking = [g for g in self.pool if g.result(self._prechecks.get(g, -1)) is None]
        return self.config.self_check and bool(checking)

    def _start_check(self, attempt: int, timeout: float, recheck: bool) -> None:
        group = self._next_group()
        ahead = not recheck and group in self._prechecks
        ident = (
            self._prechecks[group] if ahead
            else group.check(self._check_path(str(attempt)), timeout, self.config.storage)
        )  # fmt: skip
        self._prechecks[group] = ident  # a check from now counts as run ahead of the next fault too
        self._pending_check = (attempt, group, ident, ahead)
        self.state = "checking"

    def _tend_check(self) -> None:
        if self._pending_check is None:
            return
        attempt, group, ident, ahead = self._pending_check
        result = group.result(ident)
        if result is None and group.alive():
            return
        self._pending_check = None
        if result is None:  # the group died: a new one checks, a few times at most
            self._discard(group)
            self._group_failures += 1
            if self._group_failures <= WARM_GROUP_RETRIES and self.warm:
                self._start_check(attempt, self.config.check_timeout, recheck=True)
                return
            result = {"ok": False, "report": "", "summary": f"{self._group_failures} warm groups in a row "
                      "exited before their self-checks finished (see this node's log)"}  # fmt: skip
        else:
            self._group_failures = 0
        self.check = {**result, "ahead": ahead}
        self.checked_attempt, self.state = attempt, "checked"
        log.info("node %s: self-checks %s in a warm group (%s)", self.config.node,
                 "passed" if result["ok"] else "FAILED", "run ahead" if ahead else "now")  # fmt: skip

    def _start_warm(self, orders: dict[str, Any], env: dict[str, str]) -> None:
        nproc = self.config.nproc_per_node
        group, self.kept = self.kept, None
        if group is not None and (not group.alive() or group.ended is None):
            group.close()
            group = None
        if group is None:
            group = self._next_group()
            self.pool.remove(group)
            self._prechecks.pop(group, None)
        ranks = [
            rank_env(node_rank=int(orders["node_rank"]), nnodes=int(orders["nnodes"]), nproc=nproc,
                     local_rank=local, master=str(orders["master"]), run_id=str(orders["run_id"]))
            for local in range(nproc)
        ]  # fmt: skip
        group.run(env, ranks)
        how = "in place" if group.runs > 1 else "ready" if group.ready.is_set() else "still importing"
        log.info("node %s, attempt %d: warm group %s (pid %d, %s), ranks %s..%s", self.config.node,
                 self.attempt, group.name, group.pid, how, ranks[0]["RANK"], ranks[-1]["RANK"])  # fmt: skip
        self.group, self.process = group, group.process
        self._handed_out = time.monotonic()

    def _stacks_dir(self, attempt: int) -> Path:
        return self.run_dir / f"node-{self.config.node}" / "stacks" / f"attempt-{attempt}"

    def _collect_stacks(self, attempt: int, pids: dict[str, int]) -> None:
        # only this node's processes of the attempt (SIGUSR1 would end a stranger that reused a rank's pid)
        ours = {int(r): int(p) for r, p in pids.items() if same_process(int(p), self.known.get(int(p), -1))}
        found = collect_stacks(ours, self._stacks_dir(attempt))
        self.stacks, self.stacks_attempt = {str(r): text for r, text in found.items()}, attempt

    def _stop(self, keep: bool = False) -> None:
        """End this node's tree of the attempt; ``keep`` (the driver's stop, in place): a group whose ranks
        all settle after the failure is kept for the next attempt instead (`_settle_kept`)."""
        group = self.group
        if keep and self._keeping is not None:  # the driver repeats its order until the next one
            self._settle_kept()
            return
        if keep and self.config.in_place and group is not None and group.alive():
            self._keeping = time.monotonic() + IN_PLACE_WAIT_S
            if self.state == "running":
                self.state = "stopped"
            self._settle_kept()
            return
        self._keeping = None
        if self.process is not None:
            kill_tree(self.process.pid, extra=self.known)
            self.process.wait()
            self.process = None
            prune_empty(self._stacks_dir(self.attempt))
            if self.state == "running":
                self.state = "stopped"
        if self.group is not None:
            self.group.close()  # its pipes
            self.group = None

    def _settle_kept(self) -> None:
        """In place, after a stop: keep the attempt's group once its ranks settled (`WarmGroup.ended`); kill it
        when one exited or the deadline passed."""
        group = self.group
        if self._keeping is None or group is None:
            return
        if group.alive() and group.ended is not None:
            log.info("node %s, attempt %d: ranks %s settled (%.2f s); the next attempt runs in them",
                     self.config.node, self.attempt, group.ended.get("workers"), group.ended.get("settle_s", 0))  # fmt: skip
            self.kept, self.group, self.process, self._keeping = group, None, None, None
            prune_empty(self._stacks_dir(self.attempt))
        elif not group.alive() or time.monotonic() >= self._keeping:
            self._stop()  # what the ranks could not settle is killed, as without in place

    def _obey(self, orders: dict[str, Any]) -> int | None:
        action = orders.get("action", "wait")
        attempt = int(orders.get("attempt", -1))
        if action in ("check", "run") and self._warming():
            self.state = "warming"
            return None
        busy = self._checking is not None or self._pending_check is not None
        if action == "check" and self.checked_attempt != attempt and not busy and self.warm:
            timeout = min(float(orders["collective_timeout"]), float(orders["timeout"]))
            self._start_check(attempt, timeout, recheck=bool(orders.get("recheck", True)))
        elif action == "check" and self.checked_attempt != attempt and not busy:
            self.state = "checking"
            self._checking = threading.Thread(
                target=self._self_check, daemon=True, name="megascale-ft-selfcheck",
                args=(attempt, float(orders["collective_timeout"]), float(orders["timeout"])),
            )  # fmt: skip
            self._checking.start()
        elif action == "run" and attempt > self.attempt and self._keeping is not None:
            # in place: the ranks are still settling; the order comes again with the next report
            self._keeping = min(self._keeping, time.monotonic() + IN_PLACE_START_WAIT_S)
            self._settle_kept()
        elif action == "run" and attempt > self.attempt:
            self._start(orders)
        elif action == "stacks" and attempt == self.attempt and self.stacks_attempt != attempt:
            self._collect_stacks(attempt, orders.get("pids", {}))
        elif action == "stop" and attempt == self.attempt:
            self._stop(keep=bool(orders.get("keep")))
            self.stopped = attempt
        elif action in ("evicted", "done"):
            self._stop()
            if action == "evicted":
                log.error("node %s evicted by the driver: %s", self.config.node, orders.get("reason", ""))
                return 3
            return 0 if orders.get("ok") else 1
        return None

    def _tick(self) -> None:
        if self._keeping is not None:
            self._settle_kept()
        if self.kept is not None and not self.kept.alive():
            self.kept = None
        if self._checking is not None and not self._checking.is_alive():
            self._checking, self.state = None, "checked"
        if self._pending_check is not None:
            self._tend_check()
        if self.warm:
            self._tend_pool()
        if self.process is not None and self.state == "running":
            code = self.process.poll()
            if code is None and self.group is not None and self.group.ended is not None:
                code = int(self.group.ended.get("code", 1))  # in place: failed, its ranks waiting
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
                before = (self.state, self.attempt, self.stopped)
                code = self._obey(orders)
                if code is not None:
                    return code
                # unchanged: wait for the next poll; else tell the driver now (a stop, a start)
                if (self.state, self.attempt, self.stopped) == before:
                    self._wake.wait(self.config.poll)
                    self._wake.clear()
        finally:
            self._stop()
            if self.kept is not None:
                self.kept.close()
            for group in list(self.pool):
                self._discard(group)
