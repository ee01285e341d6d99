"""Time from a fault to training resumed, by phase, at 2 nodes x 2 ranks under the multi-node launcher.

Two ``megascale-ft launch --nnodes 2`` processes on this machine play the nodes (the first also runs the
driver); the job is examples/ft_ddp.py (gloo DDP, checkpoints every 2 steps). At step --fault-step node 1's
torchrun and ranks are SIGKILLed. Reported, from the driver's report.json:

- detection: from the last healthy sign of the dead rank to the driver's verdict (heartbeat-bound);
- stop: killing every node's tree of the failed attempt and hearing back from the agents;
- self-check: the next attempt's node self-checks (matmul, all-reduce, all-to-all, storage) on both nodes;
- start: torchrun on each node, c10d rendezvous at the driver's store, Python + torch imports, up to the
  first heartbeat of the new attempt;
- restore and first step: every rank has read the checkpoint (rank 0 reads, broadcast to the replicas) and
  finished its first step.

    python benchmarks/recovery.py                     # ~1 minute on 2 cores
    python benchmarks/recovery.py --no-self-check     # without the self-check phase
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


def _run(tmp: Path, args: argparse.Namespace) -> dict:
    port = _free_port()
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(OMP_NUM_THREADS="1", MEGASCALE_FT_TOKEN="recovery-benchmark-0123456789",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")])))  # fmt: skip
    common = [
        sys.executable, "-m", "megascale.ft.cli", "launch", "--nnodes=2", "--nproc-per-node=2",
        f"--heartbeat-interval={args.heartbeat}", f"--hang-timeout={4 * args.heartbeat}",
        f"--collective-timeout={16 * args.heartbeat}", f"--storage={tmp / 'ckpt'}",
        *(["--no-self-check"] if args.no_self_check else []),
    ]  # fmt: skip
    job = ["--", str(ROOT / "examples" / "ft_ddp.py"), str(tmp / "ckpt"), str(tmp / "out.pt"),
           "--steps", str(args.steps), "--fault", f"kill-node@{args.fault_step}:1"]  # fmt: skip
    nodes = [
        subprocess.Popen([*common, "--node-rank=0", f"--port={port}", f"--run-dir={tmp / 'run'}", *job], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
        subprocess.Popen([*common, "--node-rank=1", f"--driver=http://127.0.0.1:{port}",
                          f"--run-dir={tmp / 'run1'}", *job], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
    ]  # fmt: skip
    outputs = [p.communicate(timeout=600)[0] for p in nodes]
    report_path = tmp / "run" / "report.json"
    if not report_path.exists() or not json.loads(report_path.read_text())["ok"]:
        raise SystemExit("the run failed:\n" + "\n".join(o[-3000:] for o in outputs))
    return json.loads(report_path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--fault-step", type=int, default=4)
    parser.add_argument("--heartbeat", type=float, default=0.5, help="heartbeat interval in s")
    parser.add_argument("--no-self-check", action="store_true")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    rows = []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as tmp:
            started = time.time()
            report = _run(Path(tmp), args)
            failed, resumed = report["attempts"][0], report["attempts"][1]
            rows.append({
                "detection": failed["fault"]["latency"], "stop": failed["phases"]["stop"],
                "self_check": resumed["phases"]["self_check"], "start": resumed["phases"]["start"],
                "restore_and_first_step": resumed["phases"]["restore_and_first_step"],
                "fault": f"{failed['fault']['kind']} on node {failed['fault']['node']}",
                "wall": time.time() - started,
            })  # fmt: skip
    phases = ["detection", "stop", "self_check", "start", "restore_and_first_step"]
    print(f"recovery at 2 nodes x 2 ranks (gloo, CPU), heartbeat {args.heartbeat} s, "
          f"self-checks {'off' if args.no_self_check else 'on'}; fault: {rows[0]['fault']}")  # fmt: skip
    print("| phase | " + " | ".join(f"run {i + 1}" for i in range(len(rows))) + " |")
    print("|---|" + "---|" * len(rows))
    for phase in phases:
        print(f"| {phase} | " + " | ".join(f"{r[phase]:.2f} s" for r in rows) + " |")
    totals = [sum(r[p] for p in phases) for r in rows]
    print("| **fault to resumed** | " + " | ".join(f"**{t:.2f} s**" for t in totals) + " |")
    print(json.dumps({"rows": rows}, indent=None))


if __name__ == "__main__":
    main()
