"""RunSummary: the sample is what the trained model generates from the prompt, printed and saved; the loss
curve pieces a restarted run together from its CSVLogger versions (attempts.jsonl), leaving older runs out."""

from __future__ import annotations

import json

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger

from megascale.core import GPTConfig
from megascale.lightning import GPTModule, RunSummary, TokenDataModule
from megascale.lightning.loss_curve import ATTEMPTS_FILE, plot_loss_curve, read_attempts, record_attempt

CONFIG = GPTConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=2, max_seq_len=32)


def _fit(
    tmp_path, summary: RunSummary, steps: int = 4, resume: str | None = None
) -> tuple[Trainer, GPTModule]:
    torch.manual_seed(0)
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=CSVLogger(tmp_path, name="run"),
        callbacks=[summary], log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path,
    )  # fmt: skip
    module = GPTModule(CONFIG, lr=1e-2, warmup_steps=1, decay_steps=20)
    data = TokenDataModule(source="stdlib", seq_len=32, batch_size=4, max_bytes=50_000)
    trainer.fit(module, data, ckpt_path=resume)
    return trainer, module


def test_the_sample_is_the_trained_models_greedy_continuation_printed_and_saved(tmp_path, capsys):
    summary = RunSummary(prompt="def ", max_new_tokens=12, temperature=0.0)
    _, module = _fit(tmp_path, summary)
    expected = module.generate(torch.tensor([list(b"def ")]), 12, temperature=0.0)[0, 4:].tolist()
    assert summary.sample == "def " + bytes(expected).decode("utf-8", errors="replace")
    out = capsys.readouterr().out
    assert "Sample from the trained model (step 4, 12 tokens, greedy)" in out and summary.sample in out
    assert (tmp_path / "run" / "version_0" / "sample.txt").read_text() == summary.sample
    assert summary.loss_curve_path == tmp_path / "run" / "loss_curve.png"
    assert summary.loss_curve_path.stat().st_size > 0


def test_a_resumed_fit_is_drawn_as_the_second_attempt_of_the_run(tmp_path):
    first = RunSummary(max_new_tokens=0)
    trainer, _ = _fit(tmp_path, first, steps=3)
    ckpt = tmp_path / "step3.ckpt"
    trainer.save_checkpoint(ckpt)
    _fit(tmp_path, RunSummary(max_new_tokens=0), steps=6, resume=str(ckpt))
    attempts = read_attempts(tmp_path / "run", ["train/loss"])
    assert [(a.version, a.start_step) for a in attempts] == [("version_0", 0), ("version_1", 3)]
    assert [s for s, _ in attempts[0].series["train/loss"]] == [0, 1, 2]
    assert [s for s, _ in attempts[1].series["train/loss"]] == [3, 4, 5]


def test_older_runs_and_cut_lines_are_left_out_of_the_curve(tmp_path):
    for version, start, steps in [
        ("version_0", 0, [0, 1, 2]),
        ("version_1", 0, [0, 1]),
        ("version_2", 1, [1, 2]),
    ]:
        record_attempt(tmp_path, version, start)
        (tmp_path / version).mkdir()
        rows = "\n".join(f"{s},{5 - s / 10}" for s in steps)
        (tmp_path / version / "metrics.csv").write_text(f"step,train/loss\n{rows}\n")
    with open(tmp_path / ATTEMPTS_FILE, "a") as f:
        f.write('{"version": "vers')  # an append cut short by a kill
    attempts = read_attempts(tmp_path, ["train/loss", "val/loss"])
    assert [a.version for a in attempts] == ["version_1", "version_2"]  # the latest fresh start onwards
    assert attempts[1].series == {"train/loss": [(1, 4.9), (2, 4.8)], "val/loss": []}
    assert plot_loss_curve(attempts, tmp_path / "curve.png").stat().st_size > 0
    assert json.loads((tmp_path / ATTEMPTS_FILE).read_text().splitlines()[0]) == {
        "version": "version_0",
        "start_step": 0,
    }


def test_a_prompt_the_vocabulary_cannot_hold_is_refused_with_a_warning_and_training_still_ends(tmp_path):
    summary = RunSummary(prompt="é", max_new_tokens=4, loss_curve=None)  # UTF-8 bytes 0xC3 0xA9 < 256: fits
    _fit(tmp_path, summary, steps=1)
    assert summary.sample is not None and summary.sample.startswith("é")
    small = GPTConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=2, max_seq_len=32)
    module = GPTModule(small, decay_steps=4)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[refused := RunSummary(prompt="z", loss_curve=None)],
                      default_root_dir=tmp_path)  # fmt: skip
    with pytest.warns(UserWarning, match="do not fit the model's vocabulary of 50"):
        trainer.fit(module, TokenDataModule(source="random:50", seq_len=16, batch_size=2, max_bytes=2_000))
    assert refused.sample is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"max_new_tokens": -1}, ">= 0"), ({"temperature": -0.5}, "greedy"), ({"top_k": 0}, ">= 1")],
)
def test_bad_arguments_say_what_to_give(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RunSummary(**kwargs)
