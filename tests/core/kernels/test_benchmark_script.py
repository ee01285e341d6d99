"""benchmarks/kernel_bench.py runs end to end on the CPU (one timed call, no torch.compile) and prints its table."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "kernel_bench.py"


def test_benchmark_runs_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    main = runpy.run_path(str(SCRIPT), run_name="benchmark_under_test")["main"]
    main(["--device", "cpu", "--no-compile", "--warmup", "0", "--iters", "1"])
    out = capsys.readouterr().out
    assert "fused GPU backends cannot run here" in out
    for name in ("rms_norm", "layer_norm", "bias_gelu", "swiglu", "rope", "cross_entropy", "attention"):
        assert f"\n{name} " in out, name
