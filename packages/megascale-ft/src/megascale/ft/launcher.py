"""The driver: start the job under torchrun, watch it, stop it on a fault, self-check, restart.

One attempt = self-checks (``python -m megascale.ft.selfcheck`` under torchrun) and then the training
command under torchrun, with the heartbeat server's address, the token, the attempt number and the timeouts
in the environment (`megascale.ft.executor.ENV`). The attempt ends when torchrun exits or the `JobMonitor`
finds a fault; on a fault the whole process tree is killed at once and the next attempt starts, from the
latest good checkpoint (the training script loads it). Restarts are bounded by ``max_restarts``, and a run
that fails the same way ``repeat_limit`` times in a row stops with a report rather than looping.

SIGTERM to the launcher (``timeout``, SLURM, ``docker stop``, Kubernetes) is not a fault: it is forwarded to
the ranks (torchrun's children), which finish their step, save a checkpoint and exit (MegaScaleStrategy, with
FaultTolerance's two-stage snapshot); no restart follows, and the launcher exits 0 once torchrun exits 0 or every
rank reported a clean end. A second SIGTERM kills the whole tree at once.

Why torchrun with ``--max-restarts 0`` and our own loop: torchrun restarts blindly (no diagnosis, no
self-check, no notion of "the same failure again"), and its restarted gloo attempts do not reconnect
(shared notes); each of our attempts is a fresh torchrun on a fresh port.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from megascale.ft._procs import children, kill_tree, same_process
from megascale.ft.config import DriverAddress, Timeouts, TLSConfig
from megascale.ft.executor import ENV
from megascale.ft.heartbeat import HeartbeatServer, require_tls_off_loopback
from megascale.ft.monitor import Fault, JobMonitor
from megascale.ft.stacks import STACKS_ENV, prune_empty

__all__ = ["LaunchConfig", "Launcher", "Rendezvous", "RunReport", "check_command", "run_self_check"]

log = logging.getLogger("megascale.ft")

POLL_S = 0.1
# torchrun polls its workers every 0.1 s by default and then kills the healthy ones; polling slower lets
# the driver see which rank died first (a killed rank's peers die a moment later)
TORCHRUN_MONITOR_S = 2.0
STRAGGLER_CHECK_S = 10.0


@dataclass
class LaunchConfig:
    """How ``megascale-ft launch`` runs a job.

    Args:
        nproc_per_node: ranks on this machine (torchrun's ``--nproc-per-node``).
        max_restarts: restarts after the first attempt; the job fails when they are used up.
        repeat_limit: stop when this many consecutive attempts failed the same way (kind, rank, message).
        timeouts: heartbeat interval, hang and collective timeouts.
        address: where the heartbeat server listens (loopback by default).
        token: shared secret of the heartbeats; default: a fresh random one per run.
        self_check: run the self-checks before every attempt.
        self_check_timeout: seconds the self-checks may take.
        storage: checkpoint storage URL the self-check probes (also given to the job as MEGASCALE_FT_STORAGE).
        run_dir: where the report, self-check reports, logs and timeline pictures go.
        straggler_threshold: flag ranks whose compute per step exceeds this multiple of the median.
        tls: the heartbeat server's certificate and key; required when ``address`` is not loopback (the
            ranks verify the certificate against ``tls.cafile``, default the certificate itself).
    """

    nproc_per_node: int = 1
    max_restarts: int = 3
    repeat_limit: int = 3
    timeouts: Timeouts = field(default_factory=Timeouts)
    address: DriverAddress = field(default_factory=DriverAddress)
    token: str | None = None
    self_check: bool = True
    self_check_timeout: float = 300.0
    storage: str | None = None
    run_dir: str = "megascale-ft-run"
    straggler_threshold: float = 1.2
    tls: TLSConfig | None = None

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise ValueError(f"nproc_per_node must be >= 1, got {self.nproc_per_node}")
        if self.max_restarts < 0 or self.repeat_limit < 1:
            raise ValueError("max_restarts must be >= 0 and repeat_limit >= 1")
        require_tls_off_loopback(self.address.host, self.tls)


@dataclass
class RunReport:
    """What happened: every attempt's fault, the self-check verdicts, and how the run ended."""

    command: list[str]
    ok: bool = False
    reason: str = ""
    attempts: list[dict[str, Any]] = field(default_factory=list)
    evicted: dict[str, str] = field(default_factory=dict)  # multi-node: node -> why it was evicted
    # connections to the heartbeat server closed unserved (idle, slow, malformed), turned away, refused
    connections: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> str:
        lines = [f"megascale-ft: {'finished' if self.ok else 'FAILED'} after {len(self.attempts)} attempt(s)"]
        for a in self.attempts:
            fault = a.get("fault")
            what = "ok" if fault is None else f"{fault['kind']} of rank {fault['rank']}: {fault['message']}"
            if fault is not None and fault.get("node") is not None:
                what = f"{fault['kind']} on node {fault['node']} (rank {fault['rank']}): {fault['message']}"
            latency = "" if fault is None else f", noticed {fault['latency']:.2f} s after its last heartbeat"
            nodes = f" on nodes {', '.join(a['nodes'])}" if a.get("nodes") else ""
            lines.append(f"  attempt {a['attempt']}{nodes}: {what}{latency} ({a['seconds']:.1f} s)")
            if fault is not None and fault.get("stacks"):
                lines.append(f"    stacks: {fault['stacks']['summary']}")
            for s in a.get("stragglers") or []:
                where = f" on node {s['node']}" if s.get("node") is not None else ""
                lines.append(f"    straggler: rank {s['rank']}{where} computed {s['ratio']:.2f}x the median "
                             f"(flagged at step {s['step']})")  # fmt: skip
        for node, why in self.evicted.items():
            lines.append(f"  node {node} evicted: {why.splitlines()[0]}")
        c = self.connections
        if c.get("dropped_total") or c.get("turned_away") or c.get("refused"):
            peers = sorted({d["peer"].rsplit(":", 1)[0] for d in c.get("dropped", [])})
            lines.append(f"  heartbeat server: {c.get('dropped_total', 0)} connection(s) closed unserved (idle, "
                         f"slow or malformed{'; from ' + ', '.join(peers) if peers else ''}), "
                         f"{c.get('turned_away', 0)} turned away, {c.get('refused', 0)} refused")  # fmt: skip
        if self.reason:
            lines.append(f"  {self.reason}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Rendezvous:
    """One attempt's torchrun c10d rendezvous across nodes: ``nnodes`` agents meet at ``endpoint``
    (``host:port`` of a TCP store) under the attempt's own ``run_id``."""

    nnodes: int
    endpoint: str
    run_id: str
    join_timeout: float = 600.0


def _torchrun(nproc: int, command: list[str], rendezvous: Rendezvous | None = None) -> list[str]:
    """torchrun for ``command`` (``script.py args`` or ``-m module args``; a leading ``python`` is dropped):
    this machine alone, its store on loopback (`megascale.ft.torchrun`), or one node of a c10d ``rendezvous``."""
    if command and Path(command[0]).name.startswith("python"):
        command = command[1:]
    if not command:
        raise ValueError("no training command: give it after '--', e.g. -- train.py --steps 100")
    if rendezvous is None:  # this machine alone: torchrun with its store bound to loopback first
        module, where = "megascale.ft.torchrun", []
    else:  # is_host=false: the driver hosts the store, so any node may be evicted or replaced
        module, where = "torch.distributed.run", [
            f"--nnodes={rendezvous.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rendezvous.endpoint}",
            f"--rdzv-id={rendezvous.run_id}",
            f"--rdzv-conf=is_host=false,join_timeout={int(rendezvous.join_timeout)}",
        ]  # fmt: skip
    return [
        sys.executable, "-m", module, f"--nproc-per-node={nproc}", *where, "--max-restarts=0",
        f"--monitor-interval={TORCHRUN_MONITOR_S}", *command,
    ]  # fmt: skip


def check_command(command: list[str]) -> None:
    """Refuse, before any attempt, a training command whose script does not exist (retrying cannot help)."""
    if command and Path(command[0]).name.startswith("python"):
        command = command[1:]
    if not command:
        raise ValueError("no training command: give it after '--', e.g. -- train.py --steps 100")
    if command[0] in ("-m", "--module") or command[0].startswith("-"):
        return  # a module (python -m NAME): whether it imports is the first attempt's to say
    if not Path(command[0]).is_file():
        raise FileNotFoundError(
            f"the training script {command[0]} does not exist (relative to {os.getcwd()}): not starting a run; "
            "give its path after '--', or '-m package.module' for a module"
        )


# what torchrun's agent logs when a rank exits ("failed (exitcode: 2) local_rank: 0 ...") and what argparse
# or python print when they refuse a command line ("train.py: error: ...", "can't open file ...")
_EXIT_CODE = re.compile(rb"failed \(exitcode: (-?\d+)\)")
_USAGE_LINE = re.compile(rb"^(?:\S+: error: .+|.*can't open file .+)$")
USAGE_EXIT_CODE = 2  # argparse's (and python's for a missing script): the command line is wrong


class _StderrTee(threading.Thread):
    """Copies torchrun's stderr to ours line by line, noting the ranks' exit codes and usage errors."""

    def __init__(self, stream: Any) -> None:
        super().__init__(name="megascale-ft-stderr", daemon=True)
        self.stream = stream
        self.exit_codes: list[int] = []
        self.usage: list[str] = []

    def run(self) -> None:
        out = getattr(sys.stderr, "buffer", None)
        for line in iter(self.stream.readline, b""):
            if out is not None:
                out.write(line)
                out.flush()
            else:
                sys.stderr.write(line.decode(errors="replace"))
            if m := _EXIT_CODE.search(line):
                self.exit_codes.append(int(m.group(1)))
            elif _USAGE_LINE.match(line.strip()) and len(self.usage) < 4:
                self.usage.append(line.strip().decode(errors="replace"))


def run_self_check(
    nproc: int, report: Path, timeout: float, collective_timeout: float, storage: str | None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The self-checks of this machine's ``nproc`` ranks under torchrun; ``{"ok", "report", "summary"}``."""
    args = [
        "-m",
        "megascale.ft.selfcheck",
        "--report",
        str(report),
        "--timeout",
        str(min(collective_timeout, timeout)),
    ]
    if storage:
        args += ["--storage", storage]
    started = time.time()
    try:
        result = subprocess.run(
            _torchrun(nproc, args), timeout=timeout, stdin=subprocess.DEVNULL, capture_output=True, text=True,
            env=env,
        )  # fmt: skip
        code, output = result.returncode, result.stdout + result.stderr
    except subprocess.TimeoutExpired as e:
        code, output = -1, f"self-checks did not finish within {timeout} s: {e}"
    summary = ""
    if report.exists():
        from megascale.ft.selfcheck import load_report  # imports torch: only when self-checks ran

        summary = load_report(report).summary()
    ok = code == 0
    if not ok and not summary:
        summary = output.strip()[-2000:]
    log.info("self-checks %s in %.1f s%s", "passed" if ok else "FAILED", time.time() - started,
             "" if ok else f":\n{summary}")  # fmt: skip
    return {"ok": ok, "report": str(report), "summary": summary}


class Launcher:
    """Run ``command`` under torchrun with heartbeats, self-checks and bounded restarts.

    ``run()`` returns the `RunReport` (also written to ``run_dir/report.json``).
    """

    def __init__(self, command: list[str], config: LaunchConfig | None = None) -> None:
        self.command = list(command)
        self.config = config or LaunchConfig()
        self.token = self.config.token or secrets.token_hex(16)
        self.run_dir = Path(self.config.run_dir)
        self.monitor: JobMonitor | None = None
        self.stragglers: dict[int, dict[str, Any]] = {}  # rank -> the attempt's straggler record
        #: why the first attempt's command line was refused (exit code 2 before any heartbeat), if it was
        self.usage_error: str | None = None
        #: the signal that asked the run to stop (SIGTERM), if one came: no restart after it
        self.stop_signal: int | None = None
        self._process: subprocess.Popen[bytes] | None = None  # torchrun of the attempt under way
        check_command(self.command)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # only recorded here; the attempt's loop forwards it to the ranks (a rank may not have started yet)
        process = self._process
        if self.stop_signal is not None:  # a second one: no more waiting for the ranks
            log.error("second SIGTERM: killing the job's processes")
            if process is not None:
                kill_tree(process.pid, wait=0.0)
            return
        self.stop_signal = signum
        log.warning(
            "SIGTERM: forwarding it to the ranks, which finish their step, save a checkpoint and exit; no "
            "restart follows (a second SIGTERM kills them at once)"
        )

    def _forward_stop(self, process: subprocess.Popen[bytes], done: set[int]) -> None:
        """Send the stop signal to torchrun's children (the ranks) not sent it yet: torchrun itself would
        stop them with its own timeout and exit non-zero."""
        assert self.stop_signal is not None
        for pid in children(process.pid):
            if pid not in done:
                done.add(pid)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, self.stop_signal)

    # --- one attempt --------------------------------------------------------------------------------
    def _env(self, server: HeartbeatServer, attempt: int) -> dict[str, str]:
        t = self.config.timeouts
        env = dict(os.environ)
        env.update({
            ENV["url"]: server.url, ENV["token"]: self.token, ENV["attempt"]: str(attempt),
            ENV["heartbeat_interval"]: str(t.heartbeat_interval), ENV["hang_timeout"]: str(t.hang_timeout),
            ENV["collective_timeout"]: str(t.collective_timeout),
        })  # fmt: skip
        if self.config.storage:
            env["MEGASCALE_FT_STORAGE"] = self.config.storage
        env[STACKS_ENV] = str(self._stacks_dir(attempt))
        if self.config.tls is not None:
            env[ENV["cafile"]] = self.config.tls.verify_with
        return env

    def _stacks_dir(self, attempt: int) -> Path:
        return self.run_dir / "stacks" / f"attempt-{attempt}"

    def _localise_hang(self, server: HeartbeatServer, attempt: int, fault: Fault) -> Fault:
        """Every rank's stacks, before the tree is killed; the ranks that stand out go into the fault."""
        from megascale.ft.hang_map import write_hang_map
        from megascale.ft.stacks import collect_stacks, localise

        # SIGUSR1 ends a process without the handler: only ranks whose pid still names them
        pids = {b.rank: b.pid for b in server.beats() if b.host == socket.gethostname()
                and (b.pid_started is None or same_process(b.pid, b.pid_started))}  # fmt: skip
        directory = self._stacks_dir(attempt)
        report = localise(collect_stacks(pids, directory), sorted(pids), str(directory))
        log.error("hang: %s (stacks in %s)", report.summary(), directory)
        assert self.monitor is not None
        write_hang_map(directory, self.monitor.coords, report, list(range(self.monitor.world_size)))
        return replace(fault, stacks=report.to_json())

    def _self_check(self, attempt: int) -> dict[str, Any]:
        c = self.config
        return run_self_check(
            c.nproc_per_node, self.run_dir / f"selfcheck-{attempt}.json", c.self_check_timeout,
            c.timeouts.collective_timeout, c.storage,
        )  # fmt: skip

    def _attempt(self, server: HeartbeatServer, attempt: int) -> Fault | None:
        monitor = JobMonitor(self.config.nproc_per_node, self.config.timeouts)
        self.monitor = monitor
        command = _torchrun(self.config.nproc_per_node, self.command)
        log.info("attempt %d: %s", attempt, shlex.join(command))
        process = subprocess.Popen(command, env=self._env(server, attempt), stdin=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
        self._process = process
        tee = _StderrTee(process.stderr)
        tee.start()
        flagged = self.stragglers = {}  # this attempt's, for report.json
        signalled: set[int] = set()  # ranks sent the stop signal
        next_straggler_check = time.monotonic() + STRAGGLER_CHECK_S
        try:
            while True:
                if self.stop_signal is not None:
                    self._forward_stop(process, signalled)
                if time.monotonic() > next_straggler_check:
                    next_straggler_check += STRAGGLER_CHECK_S
                    flag_stragglers(monitor, flagged, self.config.straggler_threshold)
                fault = monitor.check()
                if fault is not None and fault.kind == "exception":
                    time.sleep(3 * POLL_S)  # a peer may have died first and caused this one's error
                    fault = monitor.check() or fault
                if fault is not None:
                    if fault.kind == "hung":
                        fault = self._localise_hang(server, attempt, fault)
                    return fault
                code = process.poll()
                if code is not None:
                    # every rank said so (a gloo abort at exit changes nothing); or stopped by SIGTERM and
                    # the ranks exited cleanly (a script without FaultTolerance sends no end report)
                    if monitor.finished() or (self.stop_signal is not None and code == 0):
                        if code != 0:
                            log.warning("every rank finished, but torchrun exited with code %d", code)
                        return None
                    time.sleep(POLL_S)
                    fault = monitor.check()
                    tee.join(timeout=2.0)  # torchrun has exited: its last lines (the exit codes) are in
                    if fault is None and attempt == 0 and not monitor.last_steps():
                        self.usage_error = _usage_error(tee)
                    if fault is None:
                        seen = max((r for r in monitor.last_steps().values()), default=-1)
                        message = (
                            f"torchrun exited with code {code} (last step seen {seen}); see the log above"
                        )
                        fault = Fault("exit", None, socket.gethostname(), message, time.time(), time.time())
                    return fault
                time.sleep(POLL_S)
        finally:
            self._process = None
            here = socket.gethostname()
            ranks = {
                b.pid: b.pid_started for b in server.beats() if b.host == here and b.pid_started is not None
            }
            kill_tree(process.pid, extra=ranks)
            process.wait()
            tee.join(timeout=5.0)
            prune_empty(self._stacks_dir(attempt))

    # --- the run --------------------------------------------------------------------------------------
    def run(self) -> RunReport:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        report = RunReport(command=self.command)
        monitors: list[JobMonitor] = []
        main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, self._on_sigterm) if main_thread else None
        try:
            self._run(report, monitors)
        finally:
            if main_thread:
                signal.signal(signal.SIGTERM, previous)
        write_report(self.run_dir, report, monitors, self.config.straggler_threshold)
        print(report.summary(), file=sys.stderr, flush=True)
        return report

    def _run(self, report: RunReport, monitors: list[JobMonitor]) -> None:
        signatures: list[tuple[str, int | None, str]] = []  # of the failed attempts, in order

        def on_heartbeat(beat: Any) -> None:
            if self.monitor is not None:
                self.monitor.on_heartbeat(beat)

        with HeartbeatServer(self.token, on_heartbeat, self.config.address, tls=self.config.tls) as server:
            log.info("heartbeat server on %s (token required)", server.url)
            for attempt in range(self.config.max_restarts + 1):
                if self.stop_signal is not None:
                    report.reason = "stopped by SIGTERM before the next attempt"
                    break
                started = time.time()
                entry: dict[str, Any] = {"attempt": attempt}
                if self.config.self_check:
                    entry["self_check"] = self._self_check(attempt)
                    if not entry["self_check"]["ok"]:
                        entry["seconds"] = time.time() - started
                        report.attempts.append(entry)
                        report.reason = (
                            "self-checks failed before the start; fix or replace what they name:\n"
                        )
                        report.reason += entry["self_check"]["summary"]
                        break
                if self.stop_signal is not None:
                    report.reason = "stopped by SIGTERM before the next attempt"
                    break
                server.forget()
                fault = self._attempt(server, attempt)
                if self.monitor is not None:
                    monitors.append(self.monitor)
                entry["seconds"] = time.time() - started
                entry["fault"] = None if fault is None else fault.to_json()
                entry["stragglers"] = sorted(self.stragglers.values(), key=lambda s: s["at"])
                report.attempts.append(entry)
                if self.stop_signal is not None:  # asked to stop: never a restart
                    report.ok = fault is None
                    report.reason = (
                        "stopped by SIGTERM: the ranks saved a checkpoint and exited; run the same command to "
                        "resume from it"
                        if report.ok
                        else "stopped by SIGTERM, and the ranks did not exit cleanly"
                    )
                    break
                if fault is None:
                    report.ok = True
                    break
                if self.usage_error is not None:
                    report.reason = self.usage_error
                    break
                log.error("attempt %d failed: %s", attempt, fault)
                reason = failed_the_same_way(signatures, fault, self.config.repeat_limit)
                if reason is not None:
                    report.reason = reason
                    break
            else:
                report.reason = f"gave up after {self.config.max_restarts} restarts (--max-restarts)"
            report.connections = server.connections()


def _usage_error(tee: _StderrTee) -> str | None:
    """Why not to retry a first attempt that exited before any heartbeat: a rank exited with code 2 (its
    own argument parsing, or python not finding the script), which no restart can change; else None."""
    if USAGE_EXIT_CODE not in tee.exit_codes:
        return None
    said = f": {tee.usage[0]}" if tee.usage else ""
    return (f"not restarting: the training command exited with code {USAGE_EXIT_CODE} before its first step, so "
            f"its command line is wrong{said} (fix the arguments after '--')")  # fmt: skip


def flag_stragglers(monitor: JobMonitor, flagged: dict[int, dict[str, Any]], threshold: float) -> None:
    """Log the ranks that became stragglers since the last call and add them to ``flagged`` (rank -> what
    report.json says of it: when, at which step, how much slower; a rank is named once per attempt)."""
    from megascale.ft.stragglers import find_stragglers

    steps = monitor.last_steps()
    for straggler in find_stragglers(monitor.timings(), threshold=threshold, hosts=monitor.hosts):
        if straggler.rank not in flagged:
            flagged[straggler.rank] = {
                "rank": straggler.rank, "host": straggler.host, "node": monitor.nodes.get(straggler.rank),
                "step": steps.get(straggler.rank), "at": time.time(), "ratio": round(straggler.ratio, 3),
                "compute_s": round(straggler.rank_step, 4), "median_compute_s": round(straggler.median_step, 4),
            }  # fmt: skip
            log.warning("straggler: %s", straggler)


def failed_the_same_way(
    signatures: list[tuple[str, int | None, str]], fault: Fault, limit: int
) -> str | None:
    """Record ``fault``; the reason to stop when the last ``limit`` attempts failed the same way, else None."""
    signatures.append(fault.signature)
    if signatures[-limit:] != [fault.signature] * limit:
        return None
    return (f"failed the same way {limit} times in a row ({fault}); not restarting again: fix the cause (see the "
            "log), then relaunch")  # fmt: skip


def write_report(run_dir: Path, report: RunReport, monitors: list[JobMonitor], threshold: float) -> None:
    """``report.json`` (written atomically) and the merged timeline of every attempt."""
    path = run_dir / "report.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**asdict(report), "summary": report.summary()}, indent=2))
    tmp.replace(path)
    _write_timeline(run_dir, monitors, threshold)


def _write_timeline(run_dir: Path, monitors: list[JobMonitor], threshold: float) -> None:
    """The merged timeline of every attempt (Chrome trace) and, with matplotlib, its pictures."""
    from megascale.ft import stragglers, timeline

    events: dict[int, list[dict[str, Any]]] = {}
    hosts: dict[int, str] = {}
    coords: dict[int, dict[str, int]] = {}
    for monitor in monitors:
        for rank, evs in monitor.timings().items():
            events.setdefault(rank, []).extend(evs)
        hosts.update(monitor.hosts)
        coords.update(monitor.coords)
    order = timeline.coordinate_order(coords)
    if not any(events.values()):
        return
    flagged = stragglers.find_stragglers(events, threshold=threshold, hosts=hosts)
    for s in flagged:
        log.warning("straggler: %s", s)
    timeline.write_chrome_trace(
        events, run_dir / "timeline.json", hosts=hosts, stragglers=flagged, order=order
    )
    # the picture: the last attempt that reported steps (a restart's gap would squeeze every step into a
    # sliver); the Chrome trace above holds every attempt
    last = next((i for i in range(len(monitors) - 1, -1, -1) if any(monitors[i].timings().values())), 0)
    shown = {rank: evs for rank, evs in monitors[last].timings().items() if evs}
    title = None
    if len(monitors) > 1:
        title = (f"Attempt {last} of {len(monitors)}, last 10 steps per rank (every attempt: timeline.json in "
                 "Perfetto); hatched = waiting for other ranks")  # fmt: skip
    try:
        timeline.plot_timeline(shown, run_dir / "timeline.png", hosts=hosts, order=order, title=title)
        timeline.plot_step_heatmap(events, run_dir / "step_times.png", hosts=hosts, order=order)
    except ImportError as e:
        log.info("no timeline pictures: %s", e)
