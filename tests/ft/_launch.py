"""Running a training script under ``megascale-ft launch`` from a test, with short timeouts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from tests.lightning._launch import ROOT, clean_env

HEARTBEAT, HANG, COLLECTIVE = 0.5, 3.0, 8.0


def launch_job(
    tmp: Path, script: str, *script_args: str, ranks: int = 2, self_check: bool = False, max_restarts: int = 2,
    launcher_args: tuple[str, ...] = (), env: dict[str, str] | None = None,
) -> tuple[subprocess.CompletedProcess, dict[str, Any]]:  # fmt: skip
    """Run ``script CKPT OUT script_args`` under the launcher (run dir ``tmp/run``, checkpoints ``tmp/ckpt``,
    output ``tmp/out.pt``); return the finished process and the launcher's report.json."""
    run_dir = tmp / "run"
    command = [
        sys.executable, "-m", "megascale.ft.cli", "launch", f"--nproc-per-node={ranks}",
        f"--max-restarts={max_restarts}", f"--heartbeat-interval={HEARTBEAT}", f"--hang-timeout={HANG}",
        f"--collective-timeout={COLLECTIVE}", f"--run-dir={run_dir}", *launcher_args,
        *([] if self_check else ["--no-self-check"]),
        "--", script, str(tmp / "ckpt"), str(tmp / "out.pt"), *script_args,
    ]  # fmt: skip
    result = subprocess.run(
        command, env={**clean_env(), **(env or {})}, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    return result, json.loads((run_dir / "report.json").read_text())


def launch_fit(
    tmp: Path, script: str, *script_args: str, ranks: int = 2
) -> tuple[dict[str, Any], dict[str, Any]]:
    """`launch_job` that must succeed; returns (what the script saved in OUT, report.json)."""
    result, report = launch_job(tmp, script, *script_args, ranks=ranks)
    if result.returncode != 0 or not (tmp / "out.pt").exists():
        raise AssertionError(f"launch failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return torch.load(tmp / "out.pt", weights_only=True), report
