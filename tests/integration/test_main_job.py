"""The main job's config (examples/configs/main_cpu.yaml) end to end, briefly: MegaScaleStrategy tp2 × pp2 on
4 processes, megascale-data's tree loader on the stdlib shards, megascale-ft's checkpoints and heartbeats
under its launcher. Only the length, the paths and validation's size are overridden; the loss must fall."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from megascale.data import build_stdlib_shards
from tests.lightning._launch import ROOT, clean_env

CONFIG = ROOT / "examples" / "configs" / "main_cpu.yaml"


def test_the_main_job_trains_validates_checkpoints_and_its_loss_falls(tmp_path):
    shards = build_stdlib_shards(tmp_path / "stdlib")
    steps = 16
    override = {  # YAML is a superset of JSON
        "trainer": {
            "max_steps": steps, "val_check_interval": 8, "enable_progress_bar": False,
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                       "init_args": {"save_dir": str(tmp_path / "logs"), "name": "main"}},
            "callbacks": [{"class_path": "megascale.ft.FaultTolerance",
                           "init_args": {"dirpath": str(tmp_path / "ckpt"), "every_n_steps": 8}}],
        },
        "data": {"init_args": {
            "train": {"sources": [{"urls": shards.train}], "seq_len": 128, "batch_size": 16},
            "val": {"sources": [{"urls": shards.val}], "seq_len": 128, "batch_size": 16, "lanes": 4,
                    "num_workers": 0},
            "val_batches": 2,
        }},
    }  # fmt: skip
    (tmp_path / "override.yaml").write_text(json.dumps(override))
    command = [
        sys.executable, "-m", "megascale.ft.cli", "launch", "--nproc-per-node=4", "--max-restarts=0",
        f"--run-dir={tmp_path / 'run'}", "--", "-m", "megascale.lightning.cli", "fit",
        "--config", str(CONFIG), "--config", str(tmp_path / "override.yaml"),
    ]  # fmt: skip
    result = subprocess.run(command, env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["ok"] and report["attempts"][0]["self_check"]["ok"]
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == ["step-000000008", "step-000000016"]
    assert (tmp_path / "run" / "timeline.png").stat().st_size > 0
    metrics = next((tmp_path / "logs").rglob("metrics.csv"))
    rows = list(csv.DictReader(metrics.read_text().splitlines()))
    train = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    val = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    assert len(train) >= 3 and len(val) == 2
    assert train[-1] < train[0] - 0.3 and val[-1] < val[0], (train, val)


@pytest.mark.parametrize("name", ["main_cpu", "main_8gpu", "main_multinode"])
def test_every_main_job_config_parses(name):
    """The GPU configs cannot run here; their every key must still be one the CLI knows."""
    command = [sys.executable, "-m", "megascale.lightning.cli", "fit", "--config",
               str(CONFIG.with_name(f"{name}.yaml")), "--print_config"]  # fmt: skip
    result = subprocess.run(command, env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "megascale.lightning.MegaScaleStrategy" in result.stdout
        and "megascale.ft.FaultTolerance" in result.stdout
    )
