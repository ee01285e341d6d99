"""examples/configs/hf_continue_cpu.yaml end to end, briefly: the commands of docs/guides/huggingface.md
("Continue pretraining a Hugging Face checkpoint") in order — write the tiny Llama with
examples/make_tiny_hf.py, fit it 6 steps under MegaScaleStrategy tp2 × pp2 on 4 processes on megascale-data's
stdlib shards, export the last checkpoint with ``megascale convert --to-hf`` — then transformers loads the
export, and its logits equal megascale's GPT rebuilt on one process from the same checkpoint (1e-5, float32).
The run started from the checkpoint's weights (every exported tensor within 0.01 of the original: AdamW moves
an element by at most ~lr per step, ≤ 6.3e-3 over these 6 warmup steps, while an independent random init
of std 0.02 differs by ~0.03 typically) and trained (the loss falls). Only the length, the paths, logging and
checkpointing are overridden."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.utils import logging

from megascale.data import build_stdlib_shards
from megascale.lightning.checkpoint_io import convert_to_torch, load_gpt
from megascale.lightning.cli import main
from tests.lightning._launch import ROOT, clean_env

CONFIG = ROOT / "examples" / "configs" / "hf_continue_cpu.yaml"
STEPS = 6
VOCAB = 257
logging.set_verbosity_error()


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    result = subprocess.run(
        command, env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


@pytest.mark.slow  # CI tier: docs/first-hour.md runs the same config, export and generation (test_doc_blocks)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the export reads DCP on one process
def test_the_hf_continue_example_trains_a_checkpoint_split_and_exports_what_transformers_loads(tmp_path):
    hf_dir = tmp_path / "tiny-llama"
    _run([sys.executable, "examples/make_tiny_hf.py", str(hf_dir)], timeout=120)
    shards = build_stdlib_shards(tmp_path / "stdlib")
    override = {  # YAML is a superset of JSON
        "trainer": {
            "max_steps": STEPS, "log_every_n_steps": 1, "val_check_interval": 1000, "enable_progress_bar": False,
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                       "init_args": {"save_dir": str(tmp_path / "logs"), "name": "hf"}},
            "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                           "init_args": {"dirpath": str(tmp_path / "ckpt"), "save_last": True}}],
        },
        "model": {"pretrained": str(hf_dir)},
        "data": {"init_args": {
            "train": {"sources": [{"urls": shards.train}], "seq_len": 128, "batch_size": 16,
                      "document_mask": True},  # as the example: fine-tuning keeps attention inside documents
            "val": {"sources": [{"urls": shards.val}], "seq_len": 128, "batch_size": 16, "lanes": 4,
                    "num_workers": 0, "document_mask": True},
        }},
    }  # fmt: skip
    (tmp_path / "override.yaml").write_text(json.dumps(override))
    _run([sys.executable, "-m", "megascale.lightning.cli", "fit", "--config", str(CONFIG),
          "--config", str(tmp_path / "override.yaml")], timeout=300)  # fmt: skip

    rows = csv.DictReader((tmp_path / "logs" / "hf" / "version_0" / "metrics.csv").read_text().splitlines())
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.3, losses

    ckpt, out = tmp_path / "ckpt" / "last.ckpt", tmp_path / "export"
    assert main(["convert", "--to-hf", str(ckpt), str(out)]) == 0
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    convert_to_torch(ckpt, tmp_path / "model.pt")
    ours = load_gpt(tmp_path / "model.pt").eval()
    x = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(x).logits - ours(x)[..., :VOCAB]).abs().max().item() <= 1e-5

    start, end = load_file(hf_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert start.keys() == end.keys()
    moved = {k: (end[k] - start[k]).abs().max().item() for k in start}
    assert max(moved.values()) <= 0.01, moved  # continued from the checkpoint, not from a fresh init
    assert min(moved.values()) > 0, moved  # every tensor trained
