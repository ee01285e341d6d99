"""megascale-ft's `FaultTolerance` with megascale-lightning's MegaScaleStrategy, under ``megascale-ft launch``.

A tiny GPT (dropout on, AdamW, warmup + cosine, clipping) on the resumable TokenDataModule, 8 steps on 2 CPU
ranks with a checkpoint every 3: rank 1 is killed at step 7 of the first attempt; the driver reports it dead,
restarts, and the fit resumes from the last committed checkpoint and ends with weights bit for bit equal to
an uninterrupted fit of the same layout. The data holds 12 windows, so an epoch is 3 steps at tp2 (1 at dp2)
and every checkpoint falls on an epoch boundary, where the uninterrupted run draws from the global RNG for
its new data iterator between the checkpoint step's end and the next step's start. Layouts: tp2 (DTensor shards, sequence-parallel dropout on each
rank's own generator) and dp2/ZeRO-2 (FSDP2: parameters and optimizer states as DTensor shards over dp).
Layouts whose ranks hold different entries (ZeRO-1 with dp > 1, pipelines) are refused at setup.
Bitwise holds here because with two ranks every reduction is a single commutative addition.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.ft.test_lightning import launch
from tests.lightning._launch import ROOT, clean_env, free_port

SCRIPT = "tests/integration/_fit_megascale.py"
LAYOUTS = {"tp2": ["--tp", "2"], "dp2/zero2": ["--tp", "1", "--zero-stage", "2"]}
DATA = ["--every", "3", "--max-bytes", "210"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_killed_rank_restarts_and_the_fit_ends_bitwise_equal(tmp_path: Path, layout: str) -> None:
    args = [*LAYOUTS[layout], *DATA]
    reference, report = launch(tmp_path / "uninterrupted", *args, script=SCRIPT)
    assert len(report["attempts"]) == 1 and reference["restored_step"] is None
    result, report = launch(tmp_path / "faulty", *args, "--fault", "sigkill@7:1", script=SCRIPT)
    attempts = report["attempts"]
    assert report["ok"] and len(attempts) == 2
    assert attempts[0]["fault"]["kind"] == "dead" and attempts[0]["fault"]["rank"] == 1
    assert result["restored_step"] in (3, 6)  # 6 may still have been persisting at the kill
    assert result["weights"].keys() == reference["weights"].keys()
    for key, value in reference["weights"].items():
        assert torch.equal(result["weights"][key], value), f"{layout}: {key} differs"


def test_zero1_with_data_parallel_is_refused_at_setup(tmp_path: Path) -> None:
    """Its ranks hold different optimizer entries, which could be saved but not restored: refused at once."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()), SCRIPT, str(tmp_path / "ckpt"), str(tmp_path / "out.pt"),
        "--tp", "1", "--zero-stage", "1",
    ]  # fmt: skip
    proc = subprocess.run(command, env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    assert "FaultTolerance does not support ZeRO-1 with dp=2" in proc.stderr
