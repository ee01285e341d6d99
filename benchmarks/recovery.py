"""Time from a fault to training resumed, by phase, at 2 nodes x 2 ranks under the multi-node launcher.

Two ``megascale-ft launch --nnodes 2`` processes on this machine play the nodes (the first also runs the
driver); the job is examples/ft_ddp.py (gloo DDP, checkpoints every 2 steps). At step --fault-step node 1's
attempt (its torchrun, or its warm group's supervisor, and the ranks below) is SIGKILLed (``--fault
kill-node``), or rank 1 raises (``--fault exception``: every process stays alive). Three ways to restart,
``--mode`` (a comma-separated list; ``both``: warm,cold):

- warm (the default of ``megascale-ft launch``): the next attempt runs in warm spares, processes per local
  rank that imported torch and the script's modules and self-checked before the fault; the driver assigns
  the ranks and opens a fresh store; only the faulted node checks itself again (`megascale.ft.warm`);
- cold (``--no-warm``): a fresh torchrun per node, c10d rendezvous at the driver's store, every node's
  self-checks under node-local torchruns;
- in-place (``--restart-in-place``, warm as well): a node whose ranks all outlived the fault runs the next
  attempt in those very processes, once they settled (process group destroyed, the failed run's checkpoint
  save ended); the others in warm spares. With ``--fault exception`` no process starts at all.

Reported, from the driver's report.json:

- detection: from the last healthy sign of the dead rank to the driver's verdict (heartbeat-bound);
- stop: killing every node's tree of the failed attempt and hearing back from the agents;
- self-check: the next attempt's node self-checks (matmul, all-reduce, all-to-all, storage); warm: the
  faulted node's, in its warm group, the other node's verdict from before the fault;
- start: cold: torchrun on each node, c10d rendezvous, Python + torch imports; warm and in place: handing the
  attempt's environment to the waiting ranks; up to the first heartbeat of the new attempt;
- restore and first step: every rank has joined the process group, read the checkpoint (rank 0 reads,
  broadcast to the replicas) and finished its first step.

    python benchmarks/recovery.py                     # warm and cold, ~2 minutes on 2 quiet cores
    python benchmarks/recovery.py --mode warm --repeat 3
    python benchmarks/recovery.py --no-self-check     # without the self-check phase
    python benchmarks/recovery.py --fault exception --mode warm,in-place --repeat 2
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(tmp: Path, args: argparse.Namespace, mode: str) -> dict:
    port = _free_port()
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(OMP_NUM_THREADS="1", MEGASCALE_FT_TOKEN="recovery-benchmark-0123456789",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")])))  # fmt: skip
    common = [
        sys.executable, "-m", "megascale.ft.cli", "launch", "--nnodes=2", "--nproc-per-node=2",
        f"--heartbeat-interval={args.heartbeat}", f"--hang-timeout={args.hang_timeout or 4 * args.heartbeat}",
        f"--collective-timeout={args.collective_timeout or 16 * args.heartbeat}", f"--storage={tmp / 'ckpt'}",
        *(["--no-self-check"] if args.no_self_check else []), *(["--no-warm"] if mode == "cold" else []),
        *(["--restart-in-place"] if mode == "in-place" else []),
    ]  # fmt: skip
    fault = (
        f"kill-node@{args.fault_step}:1" if args.fault == "kill-node" else f"exception@{args.fault_step}:1"
    )
    job = ["--", str(ROOT / "examples" / "ft_ddp.py"), str(tmp / "ckpt"), str(tmp / "out.pt"),
           "--steps", str(args.steps), "--fault", fault]  # fmt: skip
    logs = [tmp / "node0.log", tmp / "node1.log"]
    with logs[0].open("w") as log0, logs[1].open("w") as log1:
        nodes = [
            subprocess.Popen([*common, "--node-rank=0", f"--port={port}", f"--run-dir={tmp / 'run'}", *job],
                             env=env, stdout=log0, stderr=subprocess.STDOUT),
            subprocess.Popen([*common, "--node-rank=1", f"--driver=http://127.0.0.1:{port}",
                              f"--run-dir={tmp / 'run1'}", *job], env=env, stdout=log1, stderr=subprocess.STDOUT),
        ]  # fmt: skip
        try:
            for node in nodes:
                node.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            for node in nodes:
                node.kill()
                node.wait()
    report_path = tmp / "run" / "report.json"
    if not report_path.exists() or not json.loads(report_path.read_text())["ok"]:
        tails = "\n".join(f"--- {log.name} ---\n{log.read_text()[-4000:]}" for log in logs)
        raise SystemExit(f"the {mode} run failed or did not end within {args.timeout} s:\n{tails}")
    return json.loads(report_path.read_text())


PHASES = ["detection", "stop", "self_check", "start", "restore_and_first_step"]


def _row(report: dict, wall: float) -> dict:
    failed, resumed = report["attempts"][0], report["attempts"][1]
    return {
        "detection": failed["fault"]["latency"], "stop": failed["phases"]["stop"],
        "self_check": resumed["phases"]["self_check"], "start": resumed["phases"]["start"],
        "restore_and_first_step": resumed["phases"]["restore_and_first_step"],
        "fault": f"{failed['fault']['kind']} on node {failed['fault']['node']}",
        "warm": bool(resumed.get("warm")), "wall": wall, "load": os.getloadavg()[0],
        "in_place": sorted(n for n, g in (resumed.get("warm_groups") or {}).items() if g and g.get("in_place")),
    }  # fmt: skip


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} s"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--fault-step", type=int, default=4)
    parser.add_argument("--heartbeat", type=float, default=0.5, help="heartbeat interval in s")
    parser.add_argument("--hang-timeout", type=float, help="default 4 heartbeats")
    parser.add_argument("--collective-timeout", type=float,
                        help="default 16 heartbeats (a loaded machine may need more: 4 ranks importing torch)")  # fmt: skip
    parser.add_argument("--no-self-check", action="store_true")
    parser.add_argument(
        "--mode", default="both", help="warm, cold, in-place, comma-separated; both: warm,cold"
    )
    parser.add_argument("--fault", choices=["kill-node", "exception"], default="kill-node")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    args = parser.parse_args()
    modes = ["warm", "cold"] if args.mode == "both" else args.mode.split(",")
    if set(modes) - {"warm", "cold", "in-place"}:
        parser.error(f"--mode: {args.mode!r}; give warm, cold, in-place (comma-separated) or both")
    rows: list[tuple[str, dict]] = []
    for _ in range(args.repeat):
        for mode in modes:  # interleaved: a change in the machine's load hits both alike
            with tempfile.TemporaryDirectory() as tmp:
                started = time.time()
                report = _run(Path(tmp), args, mode)
                rows.append((mode, _row(report, time.time() - started)))
                print(json.dumps({"mode": mode, **rows[-1][1]}), file=sys.stderr, flush=True)  # as they come
                if rows[-1][1]["warm"] != (mode != "cold"):
                    raise SystemExit(
                        f"the {mode} run's restart was {'warm' if rows[-1][1]['warm'] else 'cold'}"
                    )
                if (mode == "in-place") != bool(rows[-1][1]["in_place"]):
                    raise SystemExit(
                        f"the {mode} run's restart ran in place on nodes {rows[-1][1]['in_place']}"
                    )
    print(f"recovery at 2 nodes x 2 ranks (gloo, CPU), heartbeat {args.heartbeat} s, "
          f"self-checks {'off' if args.no_self_check else 'on'}; fault: {rows[0][1]['fault']}")  # fmt: skip
    print("| phase | " + " | ".join(f"{m} {i + 1}" for i, (m, _) in enumerate(rows)) + " |")
    print("|---|" + "---:|" * len(rows))
    for phase in PHASES:
        print(f"| {phase} | " + " | ".join(_seconds(r[phase]) for _, r in rows) + " |")
    totals = [
        ("" if all(r[p] is not None for p in PHASES) else "≥ ") + f"{sum(r[p] or 0.0 for p in PHASES):.2f} s"
        for _, r in rows
    ]  # a phase not measured (n/a) makes the total a lower bound
    print("| **fault to resumed** | " + " | ".join(f"**{t}**" for t in totals) + " |")
    print("| load average (1 min, at the end) | " + " | ".join(f"{r['load']:.1f}" for _, r in rows) + " |")
    print(json.dumps({"rows": [{"mode": m, **r} for m, r in rows]}, indent=None))


if __name__ == "__main__":
    main()
