"""`megascale-ft launch` does not retry what no restart can fix: a training script that does not exist is
refused before anything starts, and one that fails its own argument parsing (exit code 2 before its first
step) ends the run after the first attempt, saying why in one line. And the ranks' store listens on loopback
only, at a port bound before torchrun starts (none chosen early for another connection to take)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = """\
import argparse
parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, required=True)
parser.parse_args()
"""


def _launch(tmp_path: Path, *command: str) -> tuple[subprocess.CompletedProcess[str], float]:
    args = [sys.executable, "-m", "megascale.ft.cli", "launch", "--nproc-per-node", "1", "--max-restarts", "3",
            "--no-self-check", "--run-dir", str(tmp_path / "run"), "--", *command]  # fmt: skip
    started = time.monotonic()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    return result, time.monotonic() - started


def test_a_missing_script_is_refused_before_any_attempt(tmp_path: Path) -> None:
    result, _ = _launch(tmp_path, "train_typo.py", "--steps", "3")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith(
        "megascale-ft launch: error: the training script train_typo.py does not exist"
    )
    assert not (tmp_path / "run").exists()  # nothing ran: no attempt, no report


def test_a_script_refusing_its_arguments_is_not_retried(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    result, _ = _launch(tmp_path, "train.py", "--stpes", "3")
    assert result.returncode == 2, result.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert len(report["attempts"]) == 1 and not report["ok"]
    assert report["reason"].startswith(
        "not restarting: the training command exited with code 2 before its first"
    )
    assert "train.py: error: the following arguments are required: --steps" in report["reason"]
    assert report["reason"] in result.stderr  # the launcher's last lines say it too


STORE_SCRIPT = """\
import json, os, sys
import torch.distributed as dist
from megascale.ft.executor import Executor

dist.init_process_group("gloo")
port = int(os.environ["MASTER_PORT"])
listening = []  # local addresses of the sockets listening on the store's port (hex, as /proc writes them)
for path in ("/proc/net/tcp", "/proc/net/tcp6"):
    with open(path) as table:
        rows = [line.split() for line in table.readlines()[1:]]
    listening += [r[1].rsplit(":", 1)[0] for r in rows if r[3] == "0A" and int(r[1].rsplit(":", 1)[1], 16) == port]
with Executor.from_env() as executor:
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as out:
            json.dump({"master_addr": os.environ["MASTER_ADDR"], "listening": listening}, out)
    dist.barrier()
    executor.step_done(0, 0.0)
dist.destroy_process_group()
os._exit(0)
"""


def test_the_ranks_store_listens_on_loopback_only(tmp_path: Path) -> None:
    """torch's TCPStore binds every interface whatever host it is given (and has no authentication); the
    launcher's torchrun binds the store's socket to 127.0.0.1 first (megascale.ft.torchrun), at a port the
    kernel picks then, so no port is chosen early for another connection to take before torchrun binds it."""
    (tmp_path / "store.py").write_text(STORE_SCRIPT)
    args = [sys.executable, "-m", "megascale.ft.cli", "launch", "--nproc-per-node", "2", "--max-restarts", "0",
            "--no-self-check", "--run-dir", str(tmp_path / "run"), "--", "store.py", str(tmp_path / "seen.json")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen == {"master_addr": "127.0.0.1", "listening": ["0100007F"]}, seen  # 127.0.0.1 only, not "*"
