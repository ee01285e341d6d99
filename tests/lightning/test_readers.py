"""What the strategy keys ZeRO-1's whole gradients and its wait after the step on (``weight_readers.py``).

GPTModule's own grad-norm logging is no reader (it sums the pieces' shares), else the default path would pay
1.5x DDP's bytes; a module or callback overriding a gradient hook is, unless it says otherwise; manual
optimization reads both; StochasticWeightAveraging reads weights at an epoch's start. That these choices give
one process's numbers is the conformance matrix's job (tests/conformance).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import BaseFinetuning, StochasticWeightAveraging

from megascale.core import GPTConfig
from megascale.lightning import GPTModule
from megascale.lightning.weight_readers import (
    gradient_readers,
    gradient_readers_after_backward,
    gradient_readers_before_step,
    manual_gradient_reader,
    weight_readers_between_steps,
)
from tests.core._tiny import TINY_GQA_GPT


class Plain(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)


class LogsGradNorm(Plain):
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        pass


class Manual(Plain):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class Reader(Callback):
    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        pass


class Quiet(Reader):
    reads_gradients = False


class Freezer(BaseFinetuning):
    def freeze_before_training(self, pl_module: LightningModule) -> None:
        pass

    def finetune_function(self, pl_module: LightningModule, epoch: int, optimizer: Any) -> None:
        pass


def _trainer(module: LightningModule, callbacks: list[Callback] | None = None) -> Trainer:
    trainer = Trainer(
        accelerator="cpu", devices=1, callbacks=callbacks, logger=False, enable_progress_bar=False
    )
    trainer.strategy.connect(module)
    return trainer


def _readers(module: LightningModule, callbacks: list[Callback] | None = None) -> tuple[list[str], list[str]]:
    trainer = _trainer(module, callbacks)
    return gradient_readers(trainer), weight_readers_between_steps(trainer)


def test_gradient_and_weight_readers_are_found_and_megascale_own_hooks_are_not() -> None:
    assert _readers(GPTModule(GPTConfig(**TINY_GQA_GPT))) == ([], [])
    assert _readers(Plain(), [Reader(), Quiet()]) == (["Reader"], [])
    assert _readers(LogsGradNorm()) == (["LogsGradNorm"], [])
    assert _readers(Manual()) == (["Manual (manual optimization)"], ["Manual (manual optimization)"])
    swa = StochasticWeightAveraging(swa_lrs=1e-2)
    assert _readers(Plain(), [swa, Freezer()]) == ([], ["StochasticWeightAveraging"])


class QuietManual(Manual):
    reads_gradients = False


def test_gradient_readers_are_told_apart_by_where_they_read() -> None:
    # each place gathers whole gradients only for the code that reads there (strategy._serve_readers)
    trainer = _trainer(LogsGradNorm(), [Reader(), Quiet()])
    assert gradient_readers_after_backward(trainer) == ["Reader"]
    assert gradient_readers_before_step(trainer) == ["LogsGradNorm"]
    assert manual_gradient_reader(trainer) is None
    assert manual_gradient_reader(_trainer(Manual())) == "Manual (manual optimization)"
    assert manual_gradient_reader(_trainer(QuietManual())) is None
