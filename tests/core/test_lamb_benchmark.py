"""benchmarks/lamb_batch.py runs (``--quick``) and reports every configuration with a finite loss."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_lamb_benchmark_reports_adamw_at_b_and_both_optimizers_at_4b(tmp_path: Path) -> None:
    out = tmp_path / "lamb.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lamb_batch.py"), "--quick", "--json", str(out)],
                   check=True, timeout=120, capture_output=True)  # fmt: skip
    result = json.loads(out.read_text())
    seen = {(r["optimizer"], r["batch"]) for r in result["summary"]}
    assert seen == {("adamw", 8), ("adamw", 32), ("lamb", 32)}
    assert all(math.isfinite(r["val_loss"]) for r in result["runs"])
    by = {(r["optimizer"], r["batch"]): r for r in result["summary"]}
    assert by[("adamw", 8)]["steps"] == 4 * by[("lamb", 32)]["steps"]  # the same token budget
