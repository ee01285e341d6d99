"""`megascale plan --emit-config run.yaml --cpu-trial trial.yaml`: the trial config trains as written on this
machine's CPU (the commands its header gives, run in a fresh directory), and the full config names what a
real run needs (steps, optimizer, learning rate, a tokenizer matching the vocabulary)."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megascale.data import build_stdlib_shards
from tests.lightning._launch import clean_env

# a 512-wide, 8-layer model of a 32000-id vocabulary on 2 GPUs with pp=2: the trial runs pp=2 on 2 processes
PLAN = ["--hidden", "512", "--layers", "8", "--heads", "8", "--vocab", "32000", "--gpus", "2",
        "--global-batch", "8", "--seq-len", "1024", "--pp", "2", "--top", "1"]  # fmt: skip


@pytest.mark.slow  # CI tier: docs/first-hour.md plans, emits and trains a (tp2) trial as written (test_doc_blocks)
def test_the_cpu_trial_of_a_plan_trains_as_written(tmp_path: Path) -> None:
    def run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([sys.executable, *args], cwd=tmp_path, env=clean_env(), capture_output=True,
                                text=True, timeout=timeout)  # fmt: skip
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
        return result

    out = run("-m", "megascale.core.plan", *PLAN, "--emit-config", "run.yaml", "--cpu-trial", "trial.yaml",
              timeout=120).stdout  # fmt: skip
    assert "megascale fit --config trial.yaml" in out
    full = yaml.safe_load((tmp_path / "run.yaml").read_text())
    assert full["trainer"]["strategy"]["init_args"]["pp"] == 2 and full["model"]["optimizer"] == "adamw"
    assert full["data"]["init_args"]["train"]["tokenizer"] == ".cache/megascale/bpe-32000"

    trial = yaml.safe_load((tmp_path / "trial.yaml").read_text())
    assert trial["trainer"]["devices"] == 2 and trial["trainer"]["strategy"]["init_args"]["pp"] == 2
    assert "megascale-data stdlib --output .cache/megascale/stdlib" in (tmp_path / "trial.yaml").read_text()
    build_stdlib_shards(tmp_path / ".cache/megascale/stdlib")  # what that header command does
    run("-m", "megascale.lightning.cli", "fit", "--config", "trial.yaml", "--trainer.logger.class_path",
        "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.init_args.save_dir", "logs",
        "--trainer.enable_progress_bar", "false", timeout=900)  # fmt: skip
    rows = list(csv.DictReader((tmp_path / "logs/lightning_logs/version_0/metrics.csv").open()))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == trial["trainer"]["max_steps"], losses
    assert (tmp_path / "checkpoints/plan-cpu-trial/last.ckpt").is_dir()
