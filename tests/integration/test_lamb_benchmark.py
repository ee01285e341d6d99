"""benchmarks/lamb_batch.py --quick: every configuration runs on the same token budget with a finite loss.

An integration test: the benchmark trains megascale-core's GPT on megascale-data's stdlib split.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_reports_adamw_at_b_and_both_optimizers_at_4b_and_8b(tmp_path: Path) -> None:
    out = tmp_path / "lamb.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "lamb_batch.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    batch = result["settings"]["batch"]
    summary = {(row["optimizer"], row["k"]): row for row in result["summary"]}
    assert set(summary) == {("adamw", 1), ("adamw", 4), ("lamb", 4), ("adamw", 8), ("lamb", 8)}
    budget = summary[("adamw", 1)]["tokens"]
    for (_, k), row in summary.items():
        assert row["batch"] == k * batch
        assert row["steps"] * k == summary[("adamw", 1)]["steps"]  # k times fewer steps ...
        assert row["tokens"] == budget  # ... on the same tokens
        assert math.isfinite(row["val_loss"])
        assert row["val_loss_vs_adamw_b"] == pytest.approx(
            row["val_loss"] / summary[("adamw", 1)]["val_loss"]
        )
    assert all(run["val_loss"] is not None and math.isfinite(run["val_loss"]) for run in result["runs"])
    assert set(result["gaps"]) == {"4B", "8B"}
    assert "| LAMB@4B |" in done.stdout  # the printed table
