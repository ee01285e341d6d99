"""`megascale-ft launch` does not retry what no restart can fix: a training script that does not exist is
refused before anything starts, and one that fails its own argument parsing (exit code 2 before its first
step) ends the run after the first attempt, saying why in one line. And an attempt does not fail for a port
taken between the launcher choosing it and torchrun binding it."""

from __future__ import annotations

import json
import os
import socket
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


def test_torchruns_port_is_free_and_below_the_ephemeral_range(monkeypatch) -> None:
    """Outgoing connections take their local ports from the ephemeral range: a port chosen there (binding
    port 0) can be taken by any of them before torchrun binds it (CI: EADDRINUSE, a failed attempt)."""
    from megascale.ft import launcher

    low = launcher._ephemeral_ports_start()
    ports = {launcher._free_port("127.0.0.1") for _ in range(16)}
    assert all(1024 <= port < low for port in ports) and len(ports) > 1, (low, ports)
    with socket.socket() as taken:  # a listener on the first candidate: the next one is chosen
        taken.bind(("127.0.0.1", min(ports)))
        taken.listen()
        candidates = iter([min(ports), max(ports)])

        class Drawn:
            def randrange(self, start: int, stop: int) -> int:
                return next(candidates)

        monkeypatch.setattr(launcher.secrets, "SystemRandom", Drawn)
        assert launcher._free_port("127.0.0.1") == max(ports)


def test_an_ephemeral_range_from_1024_leaves_the_kernel_to_choose(monkeypatch) -> None:
    from megascale.ft import launcher

    monkeypatch.setattr(launcher, "_ephemeral_ports_start", lambda: 1024)
    with socket.socket() as s:
        s.bind(("127.0.0.1", launcher._free_port("127.0.0.1")))  # free: a port the kernel gave
