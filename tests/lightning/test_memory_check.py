"""The strategy's memory check at the first batch: the planner's prediction against the device's memory."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from megascale.core import GPTConfig
from megascale.core.parallel.plan import ParallelPlan
from megascale.lightning import memory_check
from megascale.lightning.memory_check import layout_memory_warning

# ~1.3B parameters: its AdamW state alone (16 bytes per parameter at dp=1) is ~21 GB
BIG = GPTConfig(vocab_size=50304, d_model=2048, n_layers=24, n_heads=16, max_seq_len=2048)


def _batch(rows: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.zeros(rows, seq, dtype=torch.long)
    return tokens, tokens


def test_a_layout_predicted_not_to_fit_is_named_with_what_would_shrink_it() -> None:
    module = SimpleNamespace(config=BIG, optimizer_name="adamw")
    device = torch.device("cpu")
    with mock.patch.object(memory_check, "device_memory", return_value=16e9):  # a 16 GB device
        message = layout_memory_warning(
            module, ParallelPlan(zero_stage=0), 1, _batch(4, 2048), device, "bf16-mixed"
        )
        assert message is not None and "predicted to need" in message and "16.0 GB" in message
        assert "zero_stage" in message and "megascale plan" in message
        # the same model split 8 ways with ZeRO-3 and full recomputation over 8 ranks fits
        fits = ParallelPlan(tp=4, pp=2, zero_stage=2, activation_checkpointing="full", num_microbatches=4)
        assert layout_memory_warning(module, fits, 8, _batch(4, 2048), device, "bf16-mixed") is None
    with mock.patch.object(memory_check, "device_memory", return_value=None):  # memory unknown (a CPU)
        assert (
            layout_memory_warning(module, ParallelPlan(zero_stage=0), 1, _batch(4, 2048), device, "32-true")
            is None
        )
    with mock.patch.object(memory_check, "device_memory", return_value=1e6):
        not_a_gpt = SimpleNamespace(config={"d_model": 8})
        assert layout_memory_warning(not_a_gpt, ParallelPlan(), 1, _batch(1, 8), device, "32-true") is None


def test_the_strategy_warns_once_at_the_first_batch() -> None:
    from megascale.lightning import MegaScaleStrategy

    strategy = MegaScaleStrategy(zero_stage=0)
    with (
        mock.patch("megascale.lightning.strategy.layout_memory_warning", return_value="too big") as check,
        mock.patch.object(MegaScaleStrategy, "lightning_module", SimpleNamespace()),
        mock.patch.object(MegaScaleStrategy, "world_size", 1),
        mock.patch.object(MegaScaleStrategy, "root_device", torch.device("cpu")),
    ):
        with pytest.warns(UserWarning, match="MegaScaleStrategy: too big"):
            strategy._warn_if_over_memory(_batch(2, 8))
        assert check.call_count == 1
