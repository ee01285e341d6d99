"""examples/pretrain.py (megascale-core alone, no Lightning) runs, learns and samples, briefly: on one process,
and split tp2 × pp2 over 4 processes under torchrun through ``parallelize``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# a small batch keeps it brief (the held-out loss still falls 5.6 -> 4.4 nats/byte in 20 steps)
ARGS = ["examples/pretrain.py", "--steps", "20", "--corpus-mb", "0.3", "--batch-size", "8", "--seq-len", "64"]


def _run(command: list[str]) -> subprocess.CompletedProcess:
    env = {
        k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    }
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_core_only_pretraining_example_lowers_the_held_out_loss_and_prints_a_sample():
    result = _run([sys.executable, *ARGS])
    # the script exits 1 when the held-out loss did not improve
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "held-out loss:" in result.stdout and "sample:\ndef " in result.stdout


@pytest.mark.slow  # 4 ranks on 2 cores; CI tier: tests/core/test_compose.py trains every layout like one process
def test_the_example_trains_split_over_tensor_and_pipeline_ranks_with_plain_torch():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", "--master-addr=127.0.0.1",
                f"--master-port={port}"]  # fmt: skip
    result = _run([*torchrun, *ARGS, "--tp", "2", "--pp", "2"])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "layout: dp1 × pp2 × tp2, ZeRO-1" in result.stdout
    assert "held-out loss:" in result.stdout and "sample:\ndef " in result.stdout
