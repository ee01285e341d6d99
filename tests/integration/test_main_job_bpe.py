"""The main job on a BPE vocabulary, exactly as examples/configs/main_cpu.yaml's header says: its tokenizer
command and its three overrides, read from the header, train the BPE and start a 2-step fit (tp2 × pp2 on
4 processes) whose model has the BPE's vocabulary. Only the length, the paths and the callbacks are
overridden besides (no checkpoints, no sample)."""

from __future__ import annotations

import csv
import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megascale.data import build_stdlib_shards
from tests.lightning._launch import ROOT, clean_env

pytest.importorskip("tokenizers", reason="the BPE is a Hugging Face tokenizers file")

CONFIG = ROOT / "examples" / "configs" / "main_cpu.yaml"
BPE_DIR = ".cache/megascale/bpe"


def _header_commands() -> list[list[str]]:
    """The shell commands of the YAML's header comment, continuation lines joined."""
    header = []
    for line in CONFIG.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line[1:].strip())
    joined = "\n".join(header).replace("\\\n", " ")
    return [shlex.split(line) for line in joined.splitlines() if line.startswith(("megascale-", "-m "))]


def _bpe_commands() -> tuple[list[str], list[str]]:
    """(the tokenizer command, the fit's overrides after --config) the header gives for the BPE."""
    commands = _header_commands()
    train = next(c for c in commands if c[:2] == ["megascale-data", "tokenizer"])
    launch = next(c for c in commands if "--data.init_args.train.tokenizer" in c)
    fit = launch[launch.index("--config") + 2 :]
    return train, fit


def test_the_header_gives_the_overrides_the_data_benchmark_uses() -> None:
    from benchmarks._data_harness import bpe_overrides  # the repository root is on pytest's path

    train, fit = _bpe_commands()
    assert train[train.index("--output") + 1] == BPE_DIR
    vocab = int(train[train.index("--vocab-size") + 1])
    assert fit == bpe_overrides(BPE_DIR, vocab)


@pytest.mark.slow
def test_the_bpe_overrides_parse_and_the_main_job_starts(tmp_path: Path) -> None:
    train, fit = _bpe_commands()
    bpe = tmp_path / "bpe"
    train = [sys.executable, "-m", "megascale.data.cli", *train[1:]]  # the console script, from this venv
    train[train.index("--output") + 1] = str(bpe)
    done = subprocess.run(train, env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    vocab = json.loads((bpe / "tokenizer.json").read_text())["model"]["vocab"]
    overrides = [str(bpe) if arg == BPE_DIR else arg for arg in fit]
    assert int(overrides[overrides.index("--model.config.vocab_size") + 1]) >= len(vocab)

    shards = build_stdlib_shards(tmp_path / "stdlib")
    data = yaml.safe_load(CONFIG.read_text())["data"]  # all of it: a second --config replaces lists
    data["init_args"]["train"]["sources"] = [{"urls": shards.train}]
    data["init_args"]["val"]["sources"] = [{"urls": shards.val}]
    override = {
        "trainer": {
            "max_steps": 2, "log_every_n_steps": 1, "enable_progress_bar": False, "callbacks": [],
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                       "init_args": {"save_dir": str(tmp_path / "logs"), "name": "bpe"}},
        },
        "data": data,
    }  # fmt: skip
    (tmp_path / "override.yaml").write_text(json.dumps(override))  # YAML is a superset of JSON
    command = [sys.executable, "-m", "megascale.lightning.cli", "fit", "--config", str(CONFIG),
               "--config", str(tmp_path / "override.yaml"), *overrides]  # fmt: skip
    result = subprocess.run(command, env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]

    run = tmp_path / "logs" / "bpe" / "version_0"
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["model"]["config"]["vocab_size"] == 4096
    assert config["data"]["init_args"]["train"]["tokenizer"] == str(bpe)
    assert config["data"]["init_args"]["val"]["tokenizer"] == str(bpe)
    losses = [
        float(r["train/loss"]) for r in csv.DictReader((run / "metrics.csv").open()) if r.get("train/loss")
    ]
    # an untrained model over 4096 ids starts near ln(4096) = 8.3 (over the 257 byte ids: 5.5)
    assert len(losses) == 2 and all(abs(loss - math.log(4096)) < 1.0 for loss in losses), losses
