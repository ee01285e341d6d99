"""examples/pretrain.py (megascale-core alone, no Lightning) runs, learns and samples, briefly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_core_only_pretraining_example_lowers_the_held_out_loss_and_prints_a_sample():
    command = [sys.executable, "examples/pretrain.py", "--steps", "20", "--corpus-mb", "0.3"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    # the script exits 1 when the held-out loss did not improve
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "held-out loss:" in result.stdout and "sample:\ndef " in result.stdout
