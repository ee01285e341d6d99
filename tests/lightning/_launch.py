"""Launch ``tests.lightning._fit_worker`` as a subprocess tree, clean of the test process's environment.

Multi-process ``Trainer.fit`` inside pytest would re-launch pytest itself and leak the process group
(shared notes), so every fit runs in fresh processes: torchrun for several ranks, plain python for one.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
_DIST_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
)


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS and not k.startswith("TORCHELASTIC")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fit(jobs: list[dict[str, Any]], world_size: int, tmp_path: Path, timeout: float = 300) -> dict[str, Any]:
    """Run ``jobs`` on ``world_size`` CPU ranks; return rank 0's results (see _fit_worker)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec, out = tmp_path / f"spec-{world_size}.json", tmp_path / f"out-{world_size}.pt"
    spec.write_text(json.dumps({"jobs": jobs}))
    worker = ["-m", "tests.lightning._fit_worker", str(spec), str(out)]
    if world_size == 1:
        cmd = [sys.executable, *worker]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world_size}",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", *worker]  # fmt: skip
    proc = subprocess.run(cmd, env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(
            f"fit failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return torch.load(out, weights_only=True)
