"""SIGTERM during `megascale fit` (2 ranks, Lightning's own launcher): the step under way finishes, a checkpoint
is saved where ``--ckpt_path last`` finds it, every process exits 0; the resumed run continues at that step.

Lightning 2.6's own handler broadcast from inside the signal handler, in the middle of the step's gradient
collectives: every rank then blocked until the collective timeout (30 min by default) and exited 1 with no
checkpoint. Here the timeout is 60 s, so a regression fails in a minute, not in half an hour.
The signal comes from a callback (tests/lightning/_sigterm.py) as a given step starts: first to rank 0
only (the launcher process, as `timeout` or `docker stop` send it), then, in the resumed run, to both ranks (as
Kubernetes, SLURM and torchrun do).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from tests.lightning._launch import clean_env

_CONFIG = {
    "trainer": {
        "devices": 2, "max_steps": 100_000, "enable_progress_bar": False, "log_every_n_steps": 1,
        "limit_val_batches": 0, "val_check_interval": 100_000, "logger": False,
        "strategy": {"class_path": "megascale.lightning.MegaScaleStrategy", "init_args": {"timeout": "0:01:00"}},
    },
    "model": {"config": {"d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "max_seq_len": 32,
                         "sliding_window": 16}},
    "data": {"init_args": {"seq_len": 32, "batch_size": 2, "max_bytes": 20000}},
}  # fmt: skip


def _callbacks(step: int, ranks: list[int], record: str) -> list[dict]:
    return [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"dirpath": "ckpt", "every_n_train_steps": 1000, "save_on_train_epoch_end": False}},
        {"class_path": "tests.lightning._sigterm.SignalAt",
         "init_args": {"step": step, "ranks": ranks, "record": record}},
    ]  # fmt: skip


def _fit(tmp_path: Path, name: str, step: int, ranks: list[int], *extra: str) -> dict:
    config = {
        **_CONFIG,
        "trainer": {**_CONFIG["trainer"], "callbacks": _callbacks(step, ranks, f"{name}.json")},
    }
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(config))
    cmd = [sys.executable, "-m", "megascale.lightning.cli", "fit", "--config", "tiny_cpu.yaml",
           "--config", f"{name}.yaml", *extra]  # fmt: skip
    env = {k: v for k, v in clean_env().items() if not k.startswith("PL_")}
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "stopping on SIGTERM" in output, output[-6000:]
    return json.loads((tmp_path / f"{name}.json").read_text())


def test_sigterm_saves_a_checkpoint_exits_0_and_resumes_at_its_step(tmp_path):
    # to rank 0 only, in step 3 (global_step 3 -> 4): the step finishes, the run saves and stops after it
    first = _fit(tmp_path, "first", 3, [0])
    assert (first["start"], first["end"]) == (0, 4), first
    assert (tmp_path / "ckpt" / "last-preempted.ckpt").exists()
    # --ckpt_path last finds it; then SIGTERM to both ranks in step 5: stops after it again
    second = _fit(tmp_path, "second", 5, [0, 1], "--ckpt_path", "last")
    assert (second["start"], second["end"]) == (4, 6), second
