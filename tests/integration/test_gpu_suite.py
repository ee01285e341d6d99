"""benchmarks/gpu.py --smoke: every part of the GPU suite runs at toy sizes on the CPU and lands in its table,
so the script a GPU session runs in one command cannot rot between GPU sessions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_run_fills_every_part_of_the_table() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    table = done.stdout.split("Targets (issue 24):")[0]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ")]
    assert rows[0][0] == "| part", done.stdout
    errors = [r for r in rows if len(r) > 2 and r[2] == "error"]
    assert not errors, f"{errors}\n{done.stderr[-3000:]}"
    parts = {r[0].removeprefix("| ") for r in rows[1:]}
    assert parts == {"kernels", "attention", "train", "plan", "lightning"}, parts
    text = done.stdout
    assert "| rms_norm 64x128 fwd+bwd | torch |" in text  # the kernels ran (the reference: no GPU here)
    assert "| attention | B1 T32 H4/2 hd16 window 8 | flex | " in text  # FlexAttention timed, eagerly
    assert "skipped: KernelUnavailableError: kernel 'attention': backend 'flash'" in text  # skipped with why
    assert "SDPA ran its " in text  # which SDPA kernel ran is reported
    assert "megascale GPT, window 8 every other layer |" in text
    assert "transformers" in text  # measured, or skipped naming why
    assert "x the core loop's throughput" in text  # Lightning against the core loop
    assert "measured/predicted: time " in text  # the plan against the measurement
    targets = text.split("Targets (issue 24):")[1]  # each of issue 24's targets, with what was measured
    for target in (
        "end-to-end MFU",
        "Lightning path vs the core loop",
        "cross-entropy forward",
        "RMSNorm fwd+bwd",
        "window 8 at T 32",
        "windows on every other layer",
        "each kernel's check",
        "the whole suite",
    ):
        assert f"| {target}" in targets, targets
