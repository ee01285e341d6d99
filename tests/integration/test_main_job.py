"""The main job's config (examples/configs/main_cpu.yaml) end to end, briefly, with the kill drill: MegaScaleStrategy
tp2 × pp2 on 4 processes, megascale-data's tree loader on the stdlib shards, megascale-ft's checkpoints and
heartbeats under its launcher. One rank is SIGKILLed at step 13 of the first attempt; the launcher must name
it, self-check, restart from the step-8 checkpoint, and the loss curve must continue where it stopped: the
resumed run logs the same loss at step 9 as the killed one did (exact resume of weights, optimizer, data
position and RNG), and the loss falls over the run. Only the length, the paths, validation's size and the
sample's length are overridden."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megascale.data import build_stdlib_shards
from tests.lightning._launch import ROOT, clean_env

CONFIG = ROOT / "examples" / "configs" / "main_cpu.yaml"


def _losses(metrics: Path, name: str) -> dict[int, float]:
    rows = csv.DictReader(metrics.read_text().splitlines())
    return {int(r["step"]): float(r[name]) for r in rows if r.get(name)}


# slow tier: 4 ranks for 24 steps, twice; CI kills a rank of MegaScaleStrategy tp2×pp2 under megascale-ft's
# launcher in tests/integration/test_ft_megascale_strategy.py, and parses this config (below)
@pytest.mark.slow
def test_the_main_job_survives_a_killed_rank_and_its_loss_curve_continues_and_falls(tmp_path):
    shards = build_stdlib_shards(tmp_path / "stdlib")
    logs = tmp_path / "logs" / "main"
    override = {  # YAML is a superset of JSON
        "trainer": {
            "max_steps": 24, "val_check_interval": 8, "enable_progress_bar": False,
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                       "init_args": {"save_dir": str(tmp_path / "logs"), "name": "main",
                                     "flush_logs_every_n_steps": 5}},
            "callbacks": [
                {"class_path": "megascale.lightning.SpeedMonitor", "init_args": {"peak_flops": "measure"}},
                {"class_path": "megascale.lightning.RunSummary",
                 "init_args": {"prompt": "def ", "max_new_tokens": 24}},
                {"class_path": "megascale.ft.FaultTolerance",
                 "init_args": {"dirpath": str(tmp_path / "ckpt"), "every_n_steps": 8}},
                {"class_path": "tests.integration._kill_rank.KillRank", "init_args": {"step": 13, "rank": 3}},
            ],
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
        sys.executable, "-m", "megascale.ft.cli", "launch", "--nproc-per-node=4", "--max-restarts=1",
        f"--run-dir={tmp_path / 'run'}", "--", "-m", "megascale.lightning.cli", "fit",
        "--config", str(CONFIG), "--config", str(tmp_path / "override.yaml"),
    ]  # fmt: skip
    result = subprocess.run(command, env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]

    # the launcher: the dead rank named, self-checks before each attempt, one restart
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    attempts = report["attempts"]
    assert report["ok"] and len(attempts) == 2
    assert attempts[0]["fault"]["kind"] == "dead" and attempts[0]["fault"]["rank"] == 3
    assert all(a["self_check"]["ok"] for a in attempts)
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*"))[-2:] == [
        "step-000000016",
        "step-000000024",
    ]
    assert (tmp_path / "run" / "timeline.png").stat().st_size > 0

    # the loss curve continues where it stopped: attempt 1 resumed from step 8 and logs step 9 as attempt 0 did
    entries = [json.loads(line) for line in (logs / "attempts.jsonl").read_text().splitlines()]
    assert [(e["version"], e["start_step"]) for e in entries] == [("version_0", 0), ("version_1", 8)]
    killed, resumed = (_losses(logs / e["version"] / "metrics.csv", "train/loss") for e in entries)
    assert max(killed) >= 9 and min(resumed) == 9, (killed, resumed)
    assert resumed[9] == pytest.approx(killed[9], abs=1e-4), (killed, resumed)
    curve = [loss for step, loss in sorted(killed.items()) if step <= 8] + [
        resumed[s] for s in sorted(resumed)
    ]
    assert len(curve) >= 4 and curve[-1] < curve[0] - 0.3, curve
    val = sorted((_losses(logs / "version_1" / "metrics.csv", "val/loss")).items())
    assert [s for s, _ in val] == [15, 23] and val[-1][1] < val[0][1], val
    assert (logs / "loss_curve.png").stat().st_size > 0

    # the throughput figures and the sample
    speed = _losses(logs / "version_1" / "metrics.csv", "train/items_per_sec")
    assert speed and all(v > 0 for v in speed.values())
    assert _losses(logs / "version_1" / "metrics.csv", "train/device/mfu")
    assert "Sample from the trained model" in result.stdout
    assert (logs / "version_1" / "sample.txt").read_text().startswith("def ")


@pytest.mark.parametrize("name", ["main_cpu", "main_8gpu", "main_multinode"])
def test_every_main_job_config_parses(name, capsys, monkeypatch):
    """The GPU configs cannot run here; their every key must still be one the CLI knows. (In this process:
    Lightning is imported once for the three, not once per config.)"""
    from megascale.lightning.cli import main

    monkeypatch.setattr(sys, "argv", ["megascale"])  # LightningCLI must not read pytest's arguments
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exited:  # --print_config prints, then exits 0
        main(["fit", "--config", str(CONFIG.with_name(f"{name}.yaml")), "--print_config"])
    out, err = capsys.readouterr()
    assert exited.value.code in (0, None), err[-3000:]
    assert "megascale.lightning.MegaScaleStrategy" in out and "megascale.ft.FaultTolerance" in out


def test_the_long_context_config_parses(capsys, monkeypatch):
    """examples/configs/long_context_cpu.yaml: every key one the CLI knows (it trains in the slow tier below)."""
    from megascale.lightning.cli import main

    monkeypatch.setattr(sys, "argv", ["megascale"])
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exited:
        main(["fit", "--config", str(CONFIG.with_name("long_context_cpu.yaml")), "--print_config"])
    out, err = capsys.readouterr()
    assert exited.value.code in (0, None), err[-3000:]
    assert "cp: 2" in out


def test_the_moe_config_parses(capsys, monkeypatch):
    """examples/configs/moe_cpu.yaml: every key one the CLI knows (it trains in the slow tier below)."""
    from megascale.lightning.cli import main

    monkeypatch.setattr(sys, "argv", ["megascale"])
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exited:
        main(["fit", "--config", str(CONFIG.with_name("moe_cpu.yaml")), "--print_config"])
    out, err = capsys.readouterr()
    assert exited.value.code in (0, None), err[-3000:]
    assert "ep: 2" in out and "num_experts: 8" in out


# slow tier: 4 ranks, ep=2; CI proves expert parallelism against one process in tests/lightning/test_moe.py
@pytest.mark.slow
def test_the_moe_config_trains_under_expert_parallelism(tmp_path):
    shards = build_stdlib_shards(tmp_path / "stdlib")
    override = {  # YAML is a superset of JSON
        "trainer": {
            "max_steps": 6, "val_check_interval": 6, "enable_progress_bar": False,
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                       "init_args": {"save_dir": str(tmp_path / "logs"), "name": "moe"}},
        },
        "data": {"init_args": {
            "train": {"sources": [{"urls": shards.train}]}, "val": {"sources": [{"urls": shards.val}]},
        }},
    }  # fmt: skip
    (tmp_path / "override.yaml").write_text(json.dumps(override))
    command = [sys.executable, "-m", "megascale.lightning.cli", "fit", "--config",
               str(CONFIG.with_name("moe_cpu.yaml")), "--config", str(tmp_path / "override.yaml")]  # fmt: skip
    result = subprocess.run(command, env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    losses = _losses(tmp_path / "logs" / "moe" / "version_0" / "metrics.csv", "train/loss")
    assert losses and all(0 < v < 10 for v in losses.values()), losses
    load = _losses(tmp_path / "logs" / "moe" / "version_0" / "metrics.csv", "moe/load")
    assert load and all(1.0 <= v <= 8.0 for v in load.values()), load
    assert (tmp_path / "logs" / "moe" / "expert_load.png").is_file()


# slow tier: 4 ranks at 2048 tokens; CI proves each cp layout against one process in tests/lightning/test_strategy.py
@pytest.mark.slow
def test_the_long_context_config_trains_under_context_parallelism(tmp_path):
    shards = build_stdlib_shards(tmp_path / "stdlib")
    override = {  # YAML is a superset of JSON
        "trainer": {
            "max_steps": 6, "val_check_interval": 6, "enable_progress_bar": False,
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                       "init_args": {"save_dir": str(tmp_path / "logs"), "name": "long"}},
        },
        "data": {"init_args": {
            "train": {"sources": [{"urls": shards.train}]}, "val": {"sources": [{"urls": shards.val}]},
        }},
    }  # fmt: skip
    (tmp_path / "override.yaml").write_text(json.dumps(override))
    command = [sys.executable, "-m", "megascale.lightning.cli", "fit", "--config",
               str(CONFIG.with_name("long_context_cpu.yaml")), "--config", str(tmp_path / "override.yaml")]  # fmt: skip
    result = subprocess.run(command, env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "dp=2 × pp=1 × cp=2 × tp=1" in result.stdout + result.stderr
    losses = _losses(tmp_path / "logs" / "long" / "version_0" / "metrics.csv", "train/loss")
    assert losses and all(0 < v < 10 for v in losses.values()), losses
    val = _losses(tmp_path / "logs" / "long" / "version_0" / "metrics.csv", "val/loss")
    assert list(val) == [5], val
