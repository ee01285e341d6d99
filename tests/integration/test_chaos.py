"""The chaos soak's short version (benchmarks/chaos.py; `nox -s chaos` runs it for 30 minutes with every
kind of fault): the main job's model on 2 loopback nodes × 2 ranks under `megascale-ft launch`, hit once by
each of a killed rank, a corrupted checkpoint followed by a killed rank, a killed data reader
and an idle connection to the driver, in a random order at random moments. Every fault is named as what it
was in report.json, no resume loses or loads a bad checkpoint, and the final checkpoint (weights, LAMB's
moments) equals an uninterrupted run's bit for bit. The kinds left to the soak are proven in CI by their own
tests: a node's processes or its agent killed (tests/ft/test_multinode.py, test_warm_restart.py), a frozen rank
(tests/ft/test_faults.py), a slowed rank (test_ft_megascale_strategy.py); a checkpoint write killed midway is
in test_faults.py's slow tier and the soak."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.lightning._launch import ROOT, clean_env

FAULTS = ("kill-rank", "corrupt-checkpoint", "kill-reader", "idle-connection")


def test_a_short_chaos_soak_names_every_fault_loses_nothing_and_ends_bitwise_equal(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    command = [
        sys.executable, str(ROOT / "benchmarks" / "chaos.py"), "--minutes=5", "--steps=50", "--seed=1",
        f"--faults={','.join(FAULTS)}", "--pause=1,2", "--rounds=1", f"--dir={tmp_path}", f"--json={out}",
    ]  # fmt: skip
    done = subprocess.run(command, env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.exists(), done.stdout[-3000:] + done.stderr[-6000:]
    result = json.loads(out.read_text())
    summary = json.dumps({k: v for k, v in result.items() if k != "injected"}, indent=1)
    assert done.returncode == 0 and not result["problems"], summary
    assert sorted(result["faults"]) == sorted(FAULTS), summary  # each kind hit once
    assert result["bitwise_equal"], summary
    stops = sum(result["faults"][k] for k in FAULTS if k != "idle-connection")
    assert result["attempts"] == stops + 1, summary
    assert 0 < result["effective_training_time"] < 1, summary
