"""The `megascale` LightningCLI: the shipped tiny_cpu.yaml trains, every GPTModule argument (model.config.*
included) is settable, and the shipped configs can be listed and located.

The fit runs as a subprocess (`python -m megascale.lightning.cli`) with a clean environment, the way a user
runs it. The other shipped configs (several processes or GPUs) are checked to parse: every key one the CLI knows.
"""

from __future__ import annotations

import csv
import inspect
import os
import subprocess
import sys
import tomllib
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from megascale.core import GPTConfig
from megascale.lightning import GPTModule, configs
from megascale.lightning.cli import main

ROOT = Path(__file__).resolve().parents[2]

# shrink tiny_cpu.yaml to seconds: a 1-layer model on 20 kB of the standard library, validated once
_TINY = [
    "--trainer.max_steps", "3",
    "--trainer.log_every_n_steps", "1",
    "--trainer.val_check_interval", "3",
    "--trainer.limit_val_batches", "1",
    "--trainer.enable_progress_bar", "false",
    "--model.config.d_model", "32",
    "--model.config.n_layers", "1",
    "--model.config.n_heads", "2",
    "--model.config.n_kv_heads", "1",
    "--model.config.max_seq_len", "32",
    "--model.config.sliding_window", "16",
    "--data.init_args.seq_len", "32",
    "--data.init_args.batch_size", "2",
    "--data.init_args.max_bytes", "20000",
]  # fmt: skip


def clean_env() -> dict[str, str]:
    """No leftover rendezvous variables, one thread per rank (as in test_module)."""
    drop = {"MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "LOCAL_WORLD_SIZE"}
    env = {
        k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("PL_", "TORCHELASTIC_"))
    }
    env["OMP_NUM_THREADS"] = "1"
    return env


def _metrics(run: Path) -> list[dict[str, str]]:
    with open(run / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_tiny_cpu_config_trains_and_resumes_from_the_command_line(tmp_path):
    # the shipped config by name: no file of that name exists in the working directory
    cmd = [sys.executable, "-m", "megascale.lightning.cli", "fit", "--config", "tiny_cpu.yaml", *_TINY]
    result = subprocess.run(cmd, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    run = tmp_path / "lightning_logs" / "tiny_cpu" / "version_0"
    rows = _metrics(run)
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 3 and all(0 < x < 10 for x in losses)
    assert any(r.get("val/loss") for r in rows)
    saved = yaml.safe_load((run / "config.yaml").read_text())  # SaveConfigCallback: the resolved config
    assert saved["model"]["config"]["d_model"] == 32 and saved["model"]["optimizer"] == "lamb"
    assert (tmp_path / "checkpoints" / "tiny_cpu" / "last.ckpt").is_file()
    # continue to step 5 from the last checkpoint: two more steps, the token count continuing
    resume = [*cmd, "--trainer.max_steps", "5", "--ckpt_path", "last"]
    result = subprocess.run(
        resume, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    rows = _metrics(tmp_path / "lightning_logs" / "tiny_cpu" / "version_1")
    # (the "step" column is Lightning's logging counter, which a checkpoint saved at validation end restores
    # one ahead; the data position is what matters here)
    tokens = [float(r["train/tokens"]) for r in rows if r.get("train/loss")]
    assert tokens == [4 * 2 * 32, 5 * 2 * 32]


@pytest.fixture(autouse=True)
def _no_command_line(monkeypatch):
    # main(args) runs in this process: hide pytest's own arguments from LightningCLI
    monkeypatch.setattr(sys, "argv", ["megascale"])


def _printed_config(capsys, *args: str) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *args, "--print_config"])
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def test_every_module_argument_is_settable(capsys):
    printed = _printed_config(capsys)
    module_args = set(inspect.signature(GPTModule.__init__).parameters) - {"self"}
    assert module_args <= set(printed["model"])
    # the architecture comes from model.config or from model.pretrained's config.json: neither by default
    assert printed["model"]["config"] is None and printed["model"]["pretrained"] is None
    printed = _printed_config(capsys, "--model.config.d_model", "768")
    assert set(printed["model"]["config"]) == {f.name for f in fields(GPTConfig)}
    assert printed["seed_everything"] == 0
    assert printed["trainer"]["gradient_clip_val"] == 1.0  # the pretraining defaults
    assert printed["data"]["class_path"] == "megascale.lightning.TokenDataModule"  # the default data module
    # nested dataclass fields and every kind of argument, from the command line ...
    printed = _printed_config(
        capsys,
        "--model.config.d_model", "96",
        "--model.config.n_kv_heads", "2",
        "--model.config.norm", "layernorm",
        "--model.config.kernels", '{"attention": "sdpa"}',
        "--model.optimizer", "lamb",
        "--model.lr", "0.5",
        "--model.betas", "[0.8, 0.9]",
        "--model.decay_steps", "123",
        "--model.init_seed", "7",
    )  # fmt: skip
    model = printed["model"]
    assert model["config"]["d_model"] == 96 and model["config"]["n_kv_heads"] == 2
    assert model["config"]["norm"] == "layernorm" and model["config"]["kernels"] == {"attention": "sdpa"}
    assert model["optimizer"] == "lamb" and model["lr"] == 0.5 and model["betas"] == [0.8, 0.9]
    assert model["decay_steps"] == 123 and model["init_seed"] == 7
    # ... and an invalid value is refused
    with pytest.raises(SystemExit):
        main(["fit", "--model.optimizer", "sgd", "--print_config"])


def test_yaml_nests_the_config_and_a_datamodule_class_path(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "model:\n"
        "  config: {vocab_size: 100, d_model: 64, n_layers: 3, n_heads: 4, sliding_window: 32}\n"
        "  warmup_steps: 7\n"
        "data:\n"
        "  class_path: megascale.lightning.data.TokenDataModule\n"
        "  init_args: {source: 'random:100', batch_size: 3}\n"
    )
    printed = _printed_config(capsys, "--config", str(cfg))
    assert printed["model"]["config"]["n_layers"] == 3 and printed["model"]["config"]["sliding_window"] == 32
    assert printed["model"]["warmup_steps"] == 7
    assert (
        printed["data"]["init_args"]["source"] == "random:100"
        and printed["data"]["init_args"]["batch_size"] == 3
    )


def test_shipped_configs_are_listed_located_and_packaged(capsys):
    assert configs.names() == ["gpt_1b_8gpu.yaml", "tiny_cpu.yaml", "tp2_dp2_cpu.yaml", "tp2_pp2_cpu.yaml"]
    assert configs.path("tiny_cpu") == configs.path("tiny_cpu.yaml")
    assert configs.path("tiny_cpu.yaml").is_file()
    with pytest.raises(FileNotFoundError, match="shipped"):
        configs.path("nope.yaml")
    main(["configs"])
    out = capsys.readouterr().out
    assert all(name in out for name in configs.names())
    for name in configs.names():  # every shipped config is valid YAML naming the model and the data
        loaded = yaml.safe_load(configs.path(name).read_text())
        assert {"trainer", "model", "data"} <= set(loaded)
        printed = _printed_config(capsys, "--config", str(configs.path(name)))  # every key known to the CLI
        assert printed["trainer"]["callbacks"][0]["class_path"] == "megascale.lightning.SpeedMonitor"
    project = tomllib.loads((ROOT / "packages/megascale-lightning/pyproject.toml").read_text())["project"]
    assert project["scripts"]["megascale"] == "megascale.lightning.cli:main"


def test_help_lists_every_subcommand_and_each_shows_examples(capsys, monkeypatch):
    from megascale.lightning.cli import SUBCOMMANDS

    monkeypatch.setattr(sys, "argv", ["megascale"])  # main(args) runs here: hide pytest's arguments
    assert main(["--help"]) == 0
    overview = capsys.readouterr().out
    for name in ("fit", "validate", "test", "predict", "plan", "convert", "configs"):
        line = next((row for row in overview.splitlines() if row.split()[:1] == [name]), None)
        assert line and len(line.split()) > 3, f"`megascale --help` gives {name} no line of its own"
    assert set(SUBCOMMANDS) == {"fit", "validate", "test", "predict", "plan", "convert", "configs"}
    for name in SUBCOMMANDS:
        with pytest.raises(SystemExit) as exit_info:
            main([name, "--help"])
        assert exit_info.value.code in (0, None)
        text = capsys.readouterr().out
        examples = text[text.index("examples:") :] if "examples:" in text else ""
        assert f"megascale {name}" in examples, f"`megascale {name} --help` shows no example:\n{text[-800:]}"
