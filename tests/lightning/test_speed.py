"""SpeedMonitor: MFU from a given or measured peak (where Lightning knows none, as on CPUs), tokens/s in the
progress bar, global rates counted once per data-parallel replica, and clear errors for bad arguments."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.trainer.states import RunningStage

from megascale.core import GPTConfig
from megascale.lightning import GPTModule, SpeedMonitor, TokenDataModule
from megascale.lightning.speed import compute_dtype, measure_peak_flops

CONFIG = GPTConfig(
    vocab_size=50, d_model=32, n_layers=2, n_heads=2, max_seq_len=16, pad_vocab_to_multiple_of=8
)


def _fit(tmp_path, monitor: SpeedMonitor, steps: int = 6) -> Trainer:
    torch.manual_seed(0)
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=CSVLogger(tmp_path, name="speed"),
        callbacks=[monitor], log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    data = TokenDataModule(source="random:50", seq_len=16, batch_size=8, max_bytes=20_000)
    trainer.fit(GPTModule(CONFIG, decay_steps=10), data)
    return trainer


def test_mfu_is_model_flops_over_the_given_peak_and_tokens_per_second_reach_the_progress_bar(tmp_path):
    trainer = _fit(tmp_path, SpeedMonitor(peak_flops=1e9, window_size=3))
    logged = trainer.logged_metrics
    flops, tokens = float(logged["train/device/flops_per_sec"]), float(logged["train/device/items_per_sec"])
    assert float(logged["train/device/mfu"]) == pytest.approx(flops / 1e9)
    assert tokens == pytest.approx(16 * float(logged["train/device/samples_per_sec"]))  # items are tokens
    bar = trainer.progress_bar_metrics
    assert bar["tokens/s"] == pytest.approx(tokens) and bar["mfu"] == pytest.approx(flops / 1e9)
    assert "tokens/s" not in logged  # the bar's copies are not logged twice


def test_a_measured_peak_is_a_matmul_rate_and_gives_an_mfu_below_one(tmp_path):
    assert measure_peak_flops(torch.device("cpu"), torch.float32, seconds=0.1) > 1e8
    monitor = SpeedMonitor(peak_flops="measure", window_size=3)
    trainer = _fit(tmp_path, monitor)
    assert monitor.available_flops is not None and monitor.available_flops > 1e8
    assert 0 < float(trainer.logged_metrics["train/device/mfu"]) < 1
    assert compute_dtype("bf16-mixed") is torch.bfloat16 and compute_dtype("16-true") is torch.float16
    assert compute_dtype("32-true") is torch.float32


def test_without_a_peak_there_is_no_mfu_on_a_cpu_as_in_lightning(tmp_path):
    trainer = _fit(tmp_path, SpeedMonitor(window_size=3))
    assert "train/device/mfu" not in trainer.logged_metrics and "mfu" not in trainer.progress_bar_metrics


def test_global_rates_count_each_sample_once_per_data_parallel_replica():
    # tp2 × pp2 × dp1 on 4 devices: Lightning's Throughput would report 4× one replica's rate
    monitor = SpeedMonitor(window_size=2)
    monitor._dp_size = 1
    throughput = Throughput(world_size=4, window_size=2)
    throughput.update(time=1.0, batches=1, samples=8, lengths=128, flops=100)
    throughput.update(time=2.0, batches=2, samples=16, lengths=256, flops=100)
    monitor._throughputs[RunningStage.TRAINING] = throughput
    logged: dict[str, float] = {}
    connector = SimpleNamespace(should_update_logs=True, log_metrics=lambda m, step=None: logged.update(m))
    trainer = SimpleNamespace(_logger_connector=connector, state=SimpleNamespace(stage=RunningStage.TRAINING),
                              world_size=4)  # fmt: skip
    monitor._compute(trainer)  # type: ignore[arg-type]
    assert logged["train/device/items_per_sec"] == 128 and logged["train/items_per_sec"] == 128
    assert logged["train/samples_per_sec"] == 8 and logged["train/batches_per_sec"] == 1
    assert logged["train/flops_per_sec"] == 400  # FLOPs are per device: all four devices work
    assert monitor._bar == {"tokens/s": 128}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"peak_flops": "fast"}, "'measure'"), ({"peak_flops": 0}, "> 0"), ({"window_size": 1}, ">= 2")],
)
def test_bad_arguments_say_what_to_give(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpeedMonitor(**kwargs)
