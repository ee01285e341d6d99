"""`megascale plan` through the `megascale` command: dispatched to megascale-core's planner, and the config it
emits for its first choice is one LightningCLI reads whole (every key known, the strategy's arguments set)."""

from __future__ import annotations

import sys

import pytest
import yaml

from megascale.lightning.cli import main


@pytest.fixture(autouse=True)
def _no_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["megascale"])  # main(args) runs here: hide pytest's arguments


def test_plan_is_dispatched_and_its_config_parses(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run.yaml"
    code = main(["plan", "--model", "llama2-7b", "--gpus", "16", "--gpu", "h100", "--global-batch", "64",
                 "--seq-len", "4096", "--tp", "2", "--pp", "2", "--top", "2", "--emit-config", str(out)])  # fmt: skip
    assert code == 0
    assert "llama2-7b" in capsys.readouterr().out
    emitted = yaml.safe_load(out.read_text())
    assert emitted["trainer"]["max_steps"] == 1000 and emitted["model"]["optimizer"] == "adamw"
    assert emitted["model"]["lr"] == 3e-4 and emitted["model"]["warmup_steps"] == 100
    # a vocabulary of 32000: a BPE of that size, trained by the command the header gives
    assert emitted["data"]["init_args"]["train"]["tokenizer"] == ".cache/megascale/bpe-32000"
    assert (
        "megascale-data tokenizer --output .cache/megascale/bpe-32000 --vocab-size 32000" in out.read_text()
    )
    pytest.importorskip("megascale.data", reason="the emitted config reads megascale-data's WebDataModule")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(out), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    strategy = printed["trainer"]["strategy"]
    assert strategy["class_path"] == "megascale.lightning.MegaScaleStrategy"
    for key, value in emitted["trainer"]["strategy"]["init_args"].items():
        assert strategy["init_args"][key] == value
    assert strategy["init_args"]["tp"] == 2 and strategy["init_args"]["pp"] == 2
    assert printed["model"]["config"]["d_model"] == 4096 and printed["model"]["config"]["n_layers"] == 32
    assert printed["data"]["init_args"]["train"]["seq_len"] == 4096
