"""A user's mistake reaching any console script prints one line and a hint on stderr, exit code 2, no trace;
``--traceback`` (or MEGASCALE_TRACEBACK=1) shows the trace; anything else keeps its trace. The three
packages' copies of the helper are the same code.

Each command runs as a subprocess (``python -m`` the module behind the console script), as a user runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HELPERS = [
    ROOT / "packages/megascale-core/src/megascale/core/cli_errors.py",
    ROOT / "packages/megascale-data/src/megascale/data/cli_errors.py",
    ROOT / "packages/megascale-ft/src/megascale/ft/cli_errors.py",
]
SCRIPTS = {
    "megascale": ["-m", "megascale.lightning.cli"],
    "megascale-data": ["-m", "megascale.data.cli"],
    "megascale-ft": ["-m", "megascale.ft.cli"],
    "megascale plan": ["-m", "megascale.core.plan"],
}
# (console script, arguments with a mistake, what the one line must say)
MISTAKES = [
    ("megascale", ["fit", "--config", "no_such.yaml"], "megascale fit: error: --config no_such.yaml: no such file"),
    ("megascale", ["fitt"], "did you mean 'fit'?"),
    ("megascale", ["convert", "missing.ckpt", "model.pt"], "megascale convert: error: missing.ckpt"),
    ("megascale", ["convert", "--to-hf", "missing.pt", "out"], "missing.pt: no such file or checkpoint directory"),
    ("megascale-data", ["shard", "missing_dir", "--output", "out"], "input missing_dir does not exist"),
    ("megascale-data", ["inspect", "missing.jsonl"], "shards do not exist"),
    ("megascale-ft", ["launch", "--", "missing.py"], "the training script missing.py does not exist"),
    ("megascale plan", ["--model", "missing/config.json", "--gpus", "8", "--global-batch", "8"], "no such file"),
]  # fmt: skip


def _run(script: str, args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    environ.pop("MEGASCALE_TRACEBACK", None) if "MEGASCALE_TRACEBACK" not in env else None
    return subprocess.run([sys.executable, *SCRIPTS[script], *args], cwd=cwd, env=environ, capture_output=True,
                          text=True, timeout=180)  # fmt: skip


@pytest.mark.parametrize(("script", "args", "says"), MISTAKES, ids=[" ".join(m[1][:2]) for m in MISTAKES])
def test_a_mistake_is_one_line_and_exit_code_2(
    tmp_path: Path, script: str, args: list[str], says: str
) -> None:
    result = _run(script, args, tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) <= 3, result.stderr  # the message (argparse: usage + message) and the hint
    assert says in result.stderr, result.stderr


def test_traceback_flag_and_variable_show_the_trace(tmp_path: Path) -> None:
    args = ["convert", "missing.ckpt", "model.pt"]
    flagged = _run("megascale", [*args, "--traceback"], tmp_path)
    assert "Traceback" in flagged.stderr and flagged.returncode == 1, flagged.stderr[-3000:]
    by_env = _run(
        "megascale-data", ["shard", "missing_dir", "--output", "out"], tmp_path, MEGASCALE_TRACEBACK="1"
    )
    assert "Traceback" in by_env.stderr and "missing_dir does not exist" in by_env.stderr


def test_the_three_helpers_are_the_same_code() -> None:
    bodies = {path.read_text().split('"""', 2)[2] for path in HELPERS}  # all but the docstring
    assert len(bodies) == 1, (
        "megascale.{core,data,ft}.cli_errors differ below their docstrings: keep them equal"
    )


def test_bugs_keep_their_trace(capsys: pytest.CaptureFixture[str]) -> None:
    from megascale.core.cli_errors import UserError, report_user_errors

    def bug() -> int:
        raise KeyError("an internal error")

    def mistake() -> int:
        raise UserError("--gpus must be positive, got -1: give the GPU count")

    with pytest.raises(KeyError):
        report_user_errors("megascale x", bug)
    assert report_user_errors("megascale x", mistake) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0] == "megascale x: error: --gpus must be positive, got -1: give the GPU count"
    with pytest.raises(UserError):
        report_user_errors("megascale x", mistake, traceback=True)
