"""A chaos soak of megascale-ft (issue 25 item 3): the main job's model trained by two loopback "nodes" under
``megascale-ft launch --nnodes 2`` while random faults hit it, then checked against an uninterrupted run.

    python benchmarks/chaos.py --minutes 30 --steps 1400 --alongside --hang-timeout 10   # `nox -s chaos`
    python benchmarks/chaos.py --faults kill-rank,corrupt-checkpoint --minutes 3

The job is examples/configs/main_cpu.yaml (a GPT of parallel attention ∥ MLP blocks, sliding windows, LAMB;
tp2 × pp2 on 4 ranks; megascale-data's node reader on the stdlib shards; FaultTolerance's two-stage
checkpoints) split over 2 nodes of 2 ranks. For a set time a monkey, outside the job as an operator's tool
would be, waits until every rank of the current attempt has stepped, lets a random pause pass, and injects
one fault, taking the kinds in shuffled rounds so that each occurs:

- ``kill-rank``: SIGKILL of one rank;
- ``kill-node``: SIGKILL of a node's whole job tree (its torchrun or warm supervisor and every rank below);
- ``kill-agent``: SIGKILL of node 1's ``megascale-ft launch`` and everything below it (the machine is gone);
  a replacement launcher for node 1 starts 2 s later, as a scheduler would start one;
- ``sigstop``: SIGSTOP of one rank (a hang);
- ``slow``: one rank stopped 2/3 of the time (SIGSTOP/SIGCONT; a throttled host) for 24 of its steps;
- ``kill-persist``: SIGKILL of one rank while a checkpoint is being written (its directory exists, its
  manifest does not);
- ``corrupt-checkpoint``: a byte flipped in the newest committed checkpoint, then SIGKILL of a rank: the
  restart must skip that checkpoint (its checksum) and resume from the one before;
- ``kill-reader``: SIGKILL of a node's data reader process;
- ``idle-connection``: a TCP connection to the driver that sends nothing, held until the driver closes it.

At the end the soak checks that the run finished; that the failed attempts in report.json are, one for one
and in order, the faults that stop a job, each named as what it was (kind, rank or node); that the slowed
rank is named a straggler in its attempt and the idle connection among the connections the driver closed;
that no attempt resumed from a checkpoint older than the newest one intact when its fault hit (none lost) or
from the corrupted one; and that the final checkpoint's every tensor (weights, LAMB's moments, ...) equals an
uninterrupted run's bit for bit. It reports the effective training time: the time of the steps that made the
final model (each step's last run, rank 0's step times from timeline.json) over the wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megascale.ft._procs import descendants, kill_tree, pid_alive

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "configs" / "main_cpu.yaml"
TOKEN = "chaos-soak-token-0123456789abcdef"
FAULTS = ("kill-rank", "kill-node", "kill-agent", "sigstop", "slow", "kill-persist", "corrupt-checkpoint",
          "kill-reader", "idle-connection")  # fmt: skip
STOPS_THE_JOB = {"kill-rank", "kill-node", "kill-agent", "sigstop", "kill-persist", "corrupt-checkpoint",
                 "kill-reader"}  # fmt: skip
EXPECTED = {  # fault injected -> the kind report.json must give it
    "kill-rank": "dead", "kill-node": "dead", "kill-agent": "node-lost", "sigstop": "hung", "kill-persist": "dead",
    "corrupt-checkpoint": "dead", "kill-reader": "exception",
}  # fmt: skip
HEARTBEAT, HANG, COLLECTIVE = 0.5, 6.0, 20.0
SLOW_STEPS = 24  # a slowed rank's slow steps: most of the straggler window (megascale.ft.stragglers, 20)
IO_TIMEOUT = 10.0  # the driver's (megascale.ft.heartbeat.IO_TIMEOUT): an idle connection is closed after it


@dataclass
class SoakConfig:
    """One soak: how long faults are injected, which, and the job's length."""

    minutes: float = 30.0
    steps: int = 0  # 0: as many as fit in ``minutes`` at the measured rate, plus a margin
    every: int = 10  # checkpoint every this many steps
    faults: tuple[str, ...] = FAULTS
    seed: int = 0
    pause: tuple[float, float] = (20.0, 60.0)  # seconds of steady training before each fault
    slow_seconds: float = 180.0  # at most; a slowed rank is released after SLOW_STEPS of its steps
    reference: bool = True  # run the uninterrupted reference (else only the soak's own checks)
    hang_timeout: float = HANG  # the launcher's; a soak on a machine busy with other work needs more
    alongside: bool = False  # run the reference at the same time as the soak (else before it)
    rounds: int = 0  # stop injecting after this many rounds of every kind (0: only the minutes bound it)
    in_place: bool = False  # launch with --restart-in-place (nodes whose ranks outlive a fault keep them)


@dataclass
class Injected:
    kind: str
    at: float
    attempt: int  # the attempt it hit (the number of faults that stopped the job before it)
    rank: int | None = None
    node: str | None = None
    detail: str = ""
    step: int | None = None  # the step the job was at


@dataclass
class _Commits:
    """Checkpoint steps seen committed (manifest written), with when, polled from the directory."""

    root: Path
    seen: dict[int, float] = field(default_factory=dict)

    def poll(self) -> None:
        for manifest in self.root.glob("step-*/manifest.json"):
            step = int(manifest.parent.name.split("-")[1])
            self.seen.setdefault(step, time.time())

    def in_progress(self) -> Path | None:
        """A checkpoint being written: no manifest yet, a data file written in the last half second (a
        leftover of an interrupted write has none: it is rewritten when its step is saved again)."""
        now = time.time()
        for directory in self.root.glob("step-*"):
            if (directory / "manifest.json").exists():
                continue
            try:
                if any(now - f.stat().st_mtime < 0.5 for f in directory.glob("*.distcp")):
                    return directory
            except FileNotFoundError:  # pruned or rewritten meanwhile
                continue
        return None


def _override(tmp: Path, shards: Any, steps: int, every: int) -> Path:
    override = {  # YAML is a superset of JSON
        "trainer": {
            "devices": 2, "num_nodes": 2, "max_steps": steps, "val_check_interval": 25,
            "enable_progress_bar": False, "enable_model_summary": False,
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                       "init_args": {"save_dir": str(tmp / "logs"), "name": "main", "flush_logs_every_n_steps": 5}},
            "callbacks": [
                {"class_path": "megascale.lightning.RunSummary",  # attempts.jsonl: each attempt's start step
                 "init_args": {"max_new_tokens": 0, "loss_curve": None}},
                {"class_path": "megascale.ft.FaultTolerance",
                 "init_args": {"dirpath": str(tmp / "ckpt"), "every_n_steps": every, "keep_last": 3}},
            ],
        },
        "data": {"init_args": {
            "train": {"sources": [{"urls": shards.train}], "seq_len": 128, "batch_size": 16},
            "val": {"sources": [{"urls": shards.val}], "seq_len": 128, "batch_size": 16, "lanes": 4,
                    "num_workers": 0},
            "val_batches": 2,
        }},
    }  # fmt: skip
    path = tmp / "override.yaml"
    path.write_text(json.dumps(override))
    return path


class Cluster:
    """Two launcher processes playing nodes "0" (with the driver) and "1"."""

    def __init__(self, tmp: Path, override: Path, hang_timeout: float = HANG, in_place: bool = False) -> None:
        self.tmp, self.override, self.hang_timeout, self.in_place = tmp, override, hang_timeout, in_place
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.nodes: dict[str, subprocess.Popen] = {}
        self.logs: list[Path] = []
        self.started = time.time()

    def start(self, node: str) -> None:
        command = [
            sys.executable, "-m", "megascale.ft.cli", "launch", "--nnodes=2", "--nproc-per-node=2",
            f"--node-rank={node}", f"--heartbeat-interval={HEARTBEAT}", f"--hang-timeout={self.hang_timeout}",
            f"--collective-timeout={COLLECTIVE * self.hang_timeout / HANG}", "--max-restarts=1000", "--repeat-limit=1000",
            "--evict-after=1000", "--node-timeout=60", "--straggler-threshold=1.5", "--no-self-check",
            *(["--restart-in-place"] if self.in_place else []),
            f"--run-dir={self.tmp / ('run' if node == '0' else f'run-{node}-{len(self.logs)}')}",
            *([f"--port={self.port}"] if node == "0" else [f"--driver={self.url}"]),
            "--", "-m", "megascale.lightning.cli", "fit", "--config", str(CONFIG), "--config", str(self.override),
        ]  # fmt: skip
        log = self.tmp / f"node{node}-{len(self.logs)}.log"
        self.logs.append(log)
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        }
        env.update(OMP_NUM_THREADS="1", MEGASCALE_FT_TOKEN=TOKEN,
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")])))  # fmt: skip
        with log.open("w") as out:
            self.nodes[node] = subprocess.Popen(
                command, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
            )

    def status(self) -> dict[int, dict[str, Any]]:
        """The driver's latest heartbeat of every rank of the current attempt ({} while it is unreachable)."""
        request = urllib.request.Request(f"{self.url}/status", headers={"Authorization": f"Bearer {TOKEN}"})
        try:
            with urllib.request.urlopen(request, timeout=2.0) as answer:
                return {int(r): b for r, b in json.loads(answer.read()).items()}
        except OSError:
            return {}

    def running(self) -> bool:
        return self.nodes["0"].poll() is None

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for process in self.nodes.values():
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 1.0))
            except subprocess.TimeoutExpired:
                self.kill()
                raise RuntimeError(f"the run did not end within {timeout:.0f} s\n{self.tails()}") from None

    def kill(self) -> None:
        for process in self.nodes.values():
            if process.poll() is None:
                kill_tree(process.pid)

    def tails(self) -> str:
        return "\n".join(
            f"--- {log.name} ---\n{log.read_text(errors='replace')[-4000:]}" for log in self.logs
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Monkey:
    """Injects the faults, one at a time, into a steady attempt, and records what it did."""

    def __init__(self, cluster: Cluster, config: SoakConfig, ckpt: Path) -> None:
        self.cluster, self.config, self.rng = cluster, config, random.Random(config.seed)
        self.commits = _Commits(ckpt)
        self.injected: list[Injected] = []
        self.stops = 0  # faults that stopped the job so far
        self._round: list[str] = []
        self._rounds = 0  # rounds started
        self._missed: dict[str, int] = {}  # kinds whose moment passed, retried up to 3 times

    def _next_kind(self) -> str | None:
        if not self._round:
            if self.config.rounds and self._rounds >= self.config.rounds:
                return None
            self._rounds += 1
            self._round = list(self.config.faults)
            self.rng.shuffle(self._round)
        return self._round.pop()

    def steady(self, timeout: float = 600.0) -> dict[int, dict[str, Any]] | None:
        """Every rank of a new attempt has stepped twice (None: the run ended first)."""
        deadline, first = time.monotonic() + timeout, {}
        while time.monotonic() < deadline:
            self.commits.poll()
            if not self.cluster.running():
                return None
            beats = self.cluster.status()
            pids = {r: _identity(b) for r, b in beats.items()}
            if len(beats) == 4 and all(
                b["status"] == "running" and pid_alive(b["pid"]) for b in beats.values()
            ):
                if {r: first.get(r, (None, 0))[0] for r in beats} != pids:
                    first = {r: (_identity(b), b["step"]) for r, b in beats.items()}
                elif all(b["step"] >= first[r][1] + 2 for r, b in beats.items()):
                    return beats
            time.sleep(0.2)
        raise RuntimeError(f"no steady attempt within {timeout:.0f} s\n{self.cluster.tails()}")

    def run(self, until: float, last_step: int) -> None:
        while time.time() < until:
            beats = self.steady()
            if beats is None:
                return
            pause = time.time() + self.rng.uniform(*self.config.pause)
            while time.time() < min(pause, until) and self.cluster.running():
                self.commits.poll()
                time.sleep(0.1)
            beats = self.cluster.status()
            if time.time() >= until or len(beats) < 4 or max(b["step"] for b in beats.values()) > last_step:
                return
            kind = self._next_kind()
            if kind is None:
                return
            record = getattr(self, "_" + kind.replace("-", "_"))(beats)
            if record is None:  # the moment passed (no write or commit seen in time, the job restarted)
                self._missed[kind] = self._missed.get(kind, 0) + 1
                if self._missed[kind] <= 3:
                    self._round.append(kind)
                continue
            print(f"chaos: {record.kind} at step {record.step} (attempt {record.attempt}): rank {record.rank} "
                  f"node {record.node} {record.detail}", flush=True)  # fmt: skip
            self.injected.append(record)
            if kind in STOPS_THE_JOB:
                self.stops += 1
                self._await_restart(beats)

    def _await_restart(self, beats: dict[int, dict[str, Any]]) -> None:
        """Until the attempt that was hit is gone (every rank of it replaced, dead or restarted in place)."""
        old = {_identity(b) for b in beats.values()}
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and self.cluster.running():
            self.commits.poll()
            now = self.cluster.status()
            if now and not ({_identity(b) for b in now.values()} & old):
                return
            time.sleep(0.1)

    def _record(self, kind: str, beats: dict[int, dict[str, Any]], rank: int | None = None,
                node: str | None = None, detail: str = "") -> Injected:  # fmt: skip
        step = max(b["step"] for b in beats.values())
        return Injected(kind, time.time(), self.stops, rank, node, detail, step)

    def _rank(self, beats: dict[int, dict[str, Any]]) -> tuple[int, dict[str, Any]]:
        rank = self.rng.randrange(len(beats))
        return rank, beats[rank]

    # --- the faults -----------------------------------------------------------------------------------------
    def _kill_rank(self, beats: dict[int, dict[str, Any]]) -> Injected:
        rank, beat = self._rank(beats)
        os.kill(beat["pid"], signal.SIGKILL)
        return self._record("kill-rank", beats, rank, beat["node"])

    def _kill_node(self, beats: dict[int, dict[str, Any]]) -> Injected:
        node = self.rng.choice(["0", "1"])
        rank = next(r for r, b in sorted(beats.items()) if b["node"] == node)
        root = _parent(beats[rank]["pid"])  # torchrun or the warm supervisor: the attempt's root on the node
        kill_tree(root)
        return self._record("kill-node", beats, None, node, f"(tree of pid {root})")

    def _kill_agent(self, beats: dict[int, dict[str, Any]]) -> Injected:
        launcher = self.cluster.nodes["1"]  # node 0's launcher runs the driver: its loss ends the run
        kill_tree(launcher.pid)
        launcher.wait()
        record = self._record(
            "kill-agent", beats, None, "1", f"(launcher pid {launcher.pid}; replaced in 2 s)"
        )
        time.sleep(2.0)
        self.cluster.start("1")
        return record

    def _sigstop(self, beats: dict[int, dict[str, Any]]) -> Injected:
        rank, beat = self._rank(beats)
        os.kill(beat["pid"], signal.SIGSTOP)  # the agent's SIGKILL ends it when the attempt is stopped
        return self._record("sigstop", beats, rank, beat["node"])

    def _slow(self, beats: dict[int, dict[str, Any]]) -> Injected:
        """Stopped 2/3 of the time for ``SLOW_STEPS`` of its steps (the straggler window's 20: fewer slow steps
        than half of it leave the window's median fast; a time bound would give fewer on a busy machine)."""
        rank, beat = self._rank(beats)
        record = self._record("slow", beats, rank, beat["node"])
        pid, first, cycles = beat["pid"], beat["step"], 0
        end = time.monotonic() + self.config.slow_seconds
        while time.monotonic() < end and pid_alive(pid):
            try:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(0.2)
                os.kill(pid, signal.SIGCONT)
                time.sleep(0.1)
            except ProcessLookupError:
                break
            cycles += 1
            if cycles % 5 == 0:
                self.commits.poll()
                now = self.cluster.status().get(rank)
                if now is None or now["pid"] != pid or now["step"] >= first + SLOW_STEPS:
                    break
        record.detail = f"(stopped 2/3 of the time for {cycles * 0.3:.0f} s)"
        return record

    def _kill_persist(self, beats: dict[int, dict[str, Any]]) -> Injected | None:
        rank, beat = self._rank(beats)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.cluster.running():
            writing = self.commits.in_progress()
            if writing is not None:
                os.kill(beat["pid"], signal.SIGKILL)
                done = (writing / "manifest.json").exists()
                return self._record("kill-persist", beats, rank, beat["node"],
                                    f"({writing.name} {'committed just before' if done else 'not committed'})")  # fmt: skip
            time.sleep(0.002)
        return None

    def _corrupt_checkpoint(self, beats: dict[int, dict[str, Any]]) -> Injected | None:
        self.commits.poll()
        before = set(self.commits.seen)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.cluster.running():  # right after a commit: the next is far
            self.commits.poll()
            fresh = set(self.commits.seen) - before
            if fresh:
                step = max(fresh)
                files = sorted((self.commits.root / f"step-{step:09d}").glob("*.distcp"))
                target = self.rng.choice(files)
                data = bytearray(target.read_bytes())
                data[len(data) // 2] ^= 0xFF
                target.write_bytes(bytes(data))
                rank, beat = self._rank(self.cluster.status() or beats)
                os.kill(beat["pid"], signal.SIGKILL)
                return self._record("corrupt-checkpoint", beats, rank, beat["node"],
                                    f"(step {step}: {target.name})")  # fmt: skip
            time.sleep(0.005)
        return None

    def _kill_reader(self, beats: dict[int, dict[str, Any]]) -> Injected | None:
        node = self.rng.choice(["0", "1"])
        for rank, beat in sorted(beats.items()):
            for pid in descendants(beat["pid"]) if beat["node"] == node else []:
                if b"megascale.data.reader" in _cmdline(pid):
                    os.kill(pid, signal.SIGKILL)
                    return self._record(
                        "kill-reader", beats, None, node, f"(reader pid {pid}, under rank {rank})"
                    )
        return None

    def _idle_connection(self, beats: dict[int, dict[str, Any]]) -> Injected:
        """Held open on a thread (training goes on meanwhile) until the driver closes it."""
        record = self._record("idle-connection", beats)
        idle = socket.create_connection(("127.0.0.1", self.cluster.port))

        def hold() -> None:
            started = time.monotonic()
            idle.settimeout(IO_TIMEOUT + 10)
            try:
                closed = idle.recv(1) == b""
            except OSError:
                closed = True
            finally:
                idle.close()
            record.detail = f"(closed by the driver: {closed}, after {time.monotonic() - started:.1f} s)"

        threading.Thread(target=hold, daemon=True).start()
        return record


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _identity(beat: dict[str, Any]) -> tuple[int, int]:
    """A rank of an attempt: its process and the attempt (a restart in place keeps the process)."""
    return beat["pid"], beat.get("attempt", 0)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


# --- running and checking --------------------------------------------------------------------------------
def run_job(
    tmp: Path, shards: Any, steps: int, every: int, config: SoakConfig | None, hang: float = HANG
) -> dict[str, Any]:
    """One run of the job under two launchers; with ``config``, under the monkey. What happened, as a dict."""
    tmp.mkdir(parents=True, exist_ok=True)
    in_place = config is not None and config.in_place
    cluster = Cluster(tmp, _override(tmp, shards, steps, every), hang, in_place)
    cluster.start("0")
    time.sleep(0.5)  # the driver's node first
    cluster.start("1")
    monkey = None
    try:
        if config is not None:
            monkey = Monkey(cluster, config, tmp / "ckpt")
            monkey.run(until=cluster.started + 60 * config.minutes, last_step=steps - 2 * every)
        while cluster.running():  # to the end, still watching the commits
            if monkey is not None:
                monkey.commits.poll()
            time.sleep(0.2)
        cluster.wait(timeout=300)
    except BaseException:
        cluster.kill()
        raise
    wall = time.time() - cluster.started
    report_path = tmp / "run" / "report.json"
    if not report_path.exists():
        raise RuntimeError(f"no report.json\n{cluster.tails()}")
    return {
        "report": json.loads(report_path.read_text()),
        "wall": wall,
        "tails": cluster.tails(),
        "injected": [] if monkey is None else monkey.injected,
        "commits": {} if monkey is None else monkey.commits.seen,
        "attempts": _attempt_starts(tmp / "logs" / "main"),
    }


def _attempt_starts(root: Path) -> list[int]:
    """The step each attempt resumed from (RunSummary's attempts.jsonl)."""
    path = root / "attempts.jsonl"
    return [json.loads(line)["start_step"] for line in path.read_text().splitlines()] if path.exists() else []


def check(run: dict[str, Any]) -> list[str]:
    """What the soak found wrong (empty: every fault named, nothing lost)."""
    problems: list[str] = []
    report, injected = run["report"], run["injected"]
    if not report["ok"]:
        problems.append(f"the run did not finish: {report['reason']}")
    failed = [a for a in report["attempts"] if a.get("fault")]
    stopping = [i for i in injected if i.kind in STOPS_THE_JOB]
    if len(failed) != len(stopping):
        problems.append(f"{len(failed)} failed attempts for {len(stopping)} faults that stop the job: "
                        + "; ".join(f"{a['fault']['kind']} {a['fault']['message']}" for a in failed))  # fmt: skip
    for i, (attempt, fault) in enumerate(zip(failed, stopping)):
        named = attempt["fault"]
        wrong = named["kind"] != EXPECTED[fault.kind]
        wrong |= fault.rank is not None and named["rank"] != fault.rank
        wrong |= fault.node is not None and named.get("node") != fault.node
        if fault.kind == "kill-reader":
            wrong |= "data reader" not in named["message"]
        if wrong:
            problems.append(f"fault {i} ({fault.kind}, rank {fault.rank}, node {fault.node}) was named "
                            f"{named['kind']} of rank {named['rank']} on node {named.get('node')}: {named['message']}")  # fmt: skip
    attempts = report["attempts"]
    for fault in injected:
        if fault.kind == "slow":
            flagged = attempts[fault.attempt].get("stragglers", []) if fault.attempt < len(attempts) else []
            if fault.rank not in [s["rank"] for s in flagged]:
                problems.append(
                    f"slowed rank {fault.rank} (attempt {fault.attempt}) not named a straggler: {flagged}"
                )
        if fault.kind == "idle-connection":
            dropped = report.get("connections", {}).get("dropped", [])
            if not any(fault.at <= d["at"] <= fault.at + IO_TIMEOUT + 5 for d in dropped):
                problems.append(f"the idle connection of {fault.at:.0f} is not among the dropped: {dropped}")
    # resumes: never older than the newest intact checkpoint at the fault, never the corrupted one
    starts, commits = run["attempts"], run["commits"]
    corrupted: set[int] = set()
    for i, fault in enumerate(stopping):
        if fault.kind == "corrupt-checkpoint":
            corrupted.add(int(fault.detail.split()[1].rstrip(":")))
        if i + 1 >= len(starts):
            problems.append(f"no attempt after fault {i} in attempts.jsonl ({starts})")
            continue
        intact = [s for s, at in commits.items() if at < fault.at and s not in corrupted]
        newest = max(intact, default=0)
        if starts[i + 1] < newest:
            problems.append(f"after fault {i} ({fault.kind}) the run resumed from step {starts[i + 1]}, though "
                            f"step {newest} was committed and intact: a checkpoint lost")  # fmt: skip
        if starts[i + 1] in corrupted and fault.kind == "corrupt-checkpoint":
            problems.append(f"after fault {i} the run resumed from the corrupted step {starts[i + 1]}")
    return problems


def final_state(ckpt: Path, step: int) -> dict[str, Any]:
    """Every tensor of the checkpoint of ``step`` (DCP, read whole on one process)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt.parent / f"final-{step}.pt"
    dcp_to_torch_save(ckpt / f"step-{step:09d}", out)
    return _flatten(torch.load(out, weights_only=True))


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flatten(item, f"{prefix}{key}.").items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, item in enumerate(value) for k, v in _flatten(item, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): value}


def compare(soak: dict[str, Any], reference: dict[str, Any]) -> list[str]:
    import torch

    if soak.keys() != reference.keys():
        return [
            f"the final checkpoints hold different entries: {sorted(soak.keys() ^ reference.keys())[:10]}"
        ]
    differ = [k for k, v in reference.items() if isinstance(v, torch.Tensor) and not torch.equal(soak[k], v)]
    return (
        [f"{len(differ)} tensors of the final checkpoint differ from the uninterrupted run's: {differ[:5]}"]
        if differ
        else []
    )


def effective_time(run_dir: Path) -> tuple[float, int]:
    """(productive step seconds, steps): each step's last run on rank 0, from the driver's timeline."""
    trace = json.loads((run_dir / "timeline.json").read_text())
    last: dict[int, float] = {}
    for event in sorted(trace["traceEvents"], key=lambda e: e.get("ts", 0)):
        if event.get("name") == "step" and event.get("ph") == "X" and event.get("pid") == 0:
            last[int(event["args"]["step"])] = event["dur"] / 1e6
    return sum(last.values()), len(last)


def soak(tmp: Path, config: SoakConfig) -> dict[str, Any]:
    """The whole soak: the reference (unless off), the run under chaos, the checks. Returns the figures."""
    from megascale.data import build_stdlib_shards

    shards = build_stdlib_shards(tmp / "stdlib")
    steps = config.steps
    if steps <= 0:  # as many as the minutes hold at a first estimate of 1.6 s a step on 2 cores (see README)
        steps = max(config.every * 4, int(60 * config.minutes / 1.6) // config.every * config.every)
    hang, reference = config.hang_timeout, None
    if config.reference and not config.alongside:
        reference = run_job(tmp / "reference", shards, steps, config.every, None, hang)
    elif config.reference:  # at the same time, on the same cores: the soak runs on a busier machine
        done: dict[str, Any] = {}
        thread = threading.Thread(
            target=lambda: done.update(run_job(tmp / "reference", shards, steps, config.every, None, hang))
        )
        thread.start()
    run = run_job(tmp / "soak", shards, steps, config.every, config, hang)
    if config.reference and config.alongside:
        thread.join()
        if not done:
            raise RuntimeError("the uninterrupted run alongside failed (see its logs)")
        reference = done
    problems = check(run)
    if reference is not None:
        if not reference["report"]["ok"]:
            problems.append(f"the uninterrupted run failed: {reference['report']['reason']}")
        else:
            problems += compare(
                final_state(tmp / "soak" / "ckpt", steps), final_state(tmp / "reference" / "ckpt", steps)
            )
    productive, counted = effective_time(tmp / "soak" / "run")
    kinds: dict[str, int] = {}
    for fault in run["injected"]:
        kinds[fault.kind] = kinds.get(fault.kind, 0) + 1
    return {
        "steps": steps, "minutes": config.minutes, "seed": config.seed, "wall_s": round(run["wall"], 1),
        "reference_wall_s": None if reference is None else round(reference["wall"], 1),
        "productive_step_s": round(productive, 1), "steps_timed": counted,
        "effective_training_time": round(productive / run["wall"], 3),
        "reference_effective": None if reference is None else round(
            effective_time(tmp / "reference" / "run")[0] / reference["wall"], 3),
        "faults": kinds, "attempts": len(run["report"]["attempts"]),
        "injected": [dataclasses.asdict(i) for i in run["injected"]],
        "named": [a["fault"] and f"{a['fault']['kind']} rank {a['fault']['rank']} node {a['fault'].get('node')}"
                  for a in run["report"]["attempts"]],
        "resumed_from": run["attempts"], "problems": problems,
        # per restart, the nodes whose ranks ran it in the processes of the attempt before (--in-place)
        "in_place": [sorted(n for n, g in (a.get("warm_groups") or {}).items() if g and g.get("in_place"))
                     for a in run["report"]["attempts"][1:]],
        "bitwise_equal": reference is not None and not any("final checkpoint" in p for p in problems),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=30.0, help="how long faults are injected")
    parser.add_argument(
        "--steps", type=int, default=0, help="the job's length (default: what the minutes hold)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--hang-timeout", type=float, default=HANG, help="the launcher's (s; more on a busy machine)"
    )
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}")
    parser.add_argument(
        "--no-reference", action="store_true", help="skip the uninterrupted run (no bitwise check)"
    )
    parser.add_argument("--alongside", action="store_true", help="run the uninterrupted run at the same time")
    parser.add_argument("--pause", default="20,60", help="seconds of steady training before a fault: MIN,MAX")
    parser.add_argument(
        "--rounds", type=int, default=0, help="stop injecting after this many rounds of every kind"
    )
    parser.add_argument("--every", type=int, default=10, help="checkpoint every this many steps")
    parser.add_argument("--in-place", action="store_true", help="launch with --restart-in-place")
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument("--dir", type=Path, help="keep everything here (default: a temporary directory)")
    args = parser.parse_args()
    faults = tuple(f for f in args.faults.split(",") if f)
    unknown = set(faults) - set(FAULTS)
    if unknown:
        parser.error(f"unknown fault kind(s) {sorted(unknown)}; choose from {', '.join(FAULTS)}")
    config = SoakConfig(minutes=args.minutes, steps=args.steps, faults=faults, seed=args.seed,
                        hang_timeout=args.hang_timeout, reference=not args.no_reference,
                        alongside=args.alongside, rounds=args.rounds, every=args.every, in_place=args.in_place,
                        pause=tuple(float(v) for v in args.pause.split(",")))  # type: ignore[arg-type]  # fmt: skip
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        result = soak(args.dir or Path(scratch), config)
    print(json.dumps(result, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(result))
    raise SystemExit(1 if result["problems"] else 0)


if __name__ == "__main__":
    main()
