"""benchmarks/moe.py --quick: the dense GPT and the MoE at equal active parameters both train in one process and on
two gloo ranks (dp2 / ep2), and every figure of the table is filled: tokens/s, the ratio, memory per rank
against the planner."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_compares_dense_and_moe_in_one_process_and_at_dp2_vs_ep2(tmp_path: Path) -> None:
    out = tmp_path / "moe.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "moe.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {(r["world"], r["model"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(1, "dense"), (1, "moe"), (2, "dense"), (2, "moe")}
    for (world, model), r in rows.items():
        assert r["tokens_per_s"] > 0 and math.isfinite(r["moe_over_dense"]), (world, model)
        assert len(r["times"]) == 2  # --quick: 2 rounds
        # the measured activations are what the planner predicts (ep2 within its uneven routing)
        assert r["activations"] == pytest.approx(r["predicted"]["activations"], rel=0.05), (world, model)
        assert r["step_peak"] >= r["parameters"] + r["gradients"] + r["optimizer_state"]
    for world in (1, 2):
        dense, moe = rows[(world, "dense")], rows[(world, "moe")]
        assert dense["moe_over_dense"] == 1.0
        assert moe["total_params"] > moe["active_params"] == pytest.approx(dense["active_params"], rel=0.01)
    # ep2 holds half the experts per rank: fewer parameter bytes than the one-process MoE, more than dense
    assert rows[(2, "dense")]["parameters"] < rows[(2, "moe")]["parameters"] < rows[(1, "moe")]["parameters"]
    assert "| ep2 (2 gloo ranks) | moe |" in done.stdout  # the printed table
