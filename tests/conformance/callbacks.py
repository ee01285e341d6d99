"""Callbacks the scenarios use (as users write them) and the one that records what user code sees."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import BaseFinetuning, StochasticWeightAveraging


def whole(t: torch.Tensor) -> torch.Tensor:
    """A parameter or gradient as one process holds it (a collective for DTensors: every rank calls it)."""
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).float().clone()


class Recorder(Callback):
    """Every metric the module logged, after each training batch and each validation run."""

    reads_weights_between_steps = False
    reads_gradients = False

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.validations: list[dict[str, float]] = []

    @staticmethod
    def _scalars(metrics: dict[str, Any], prefix: str | None = None) -> dict[str, float]:
        out = {}
        for key, value in metrics.items():
            if prefix is not None and not key.startswith(prefix):
                continue
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                out[key] = float(value.full_tensor() if hasattr(value, "full_tensor") else value)
        return out

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        metrics = self._scalars(trainer.callback_metrics)
        self.steps.append({k: v for k, v in metrics.items() if not k.startswith("val/")})

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self.validations.append(self._scalars(trainer.callback_metrics, "val/"))


class Finetune(BaseFinetuning):
    """Lightning's own recipe: the blocks frozen before training, unfrozen at epoch 1."""

    def freeze_before_training(self, pl_module: LightningModule) -> None:
        self.freeze(pl_module.net.blocks, train_bn=False)  # type: ignore[union-attr]

    def finetune_function(self, pl_module: LightningModule, current_epoch: int, optimizer: Any) -> None:
        if current_epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.net.blocks, optimizer, lr=3e-3)  # type: ignore[union-attr]


class AddParamGroup(Callback):
    """Parameters frozen from the start join the optimizer in a new group at step 3 (mid-epoch)."""

    reads_weights_between_steps = False
    reads_gradients = False

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                             batch_idx: int) -> None:  # fmt: skip
        if trainer.global_step != 3:
            return
        frozen = [p for p in pl_module.parameters() if not p.requires_grad]
        for p in frozen:
            p.requires_grad_(True)
        trainer.optimizers[0].add_param_group({"params": frozen, "lr": 5e-3})


class FreezeMidRun(Callback):
    """The first block frozen at step 2 and left in the optimizer: from then on it must not move."""

    reads_weights_between_steps = False
    reads_gradients = False

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                             batch_idx: int) -> None:  # fmt: skip
        if trainer.global_step == 2:
            for p in pl_module.net.blocks[0].parameters():  # type: ignore[union-attr]
                p.requires_grad_(False)


class EMA(Callback):
    """An exponential moving average of every weight, updated after each optimizer step (a user's own)."""

    reads_gradients = False  # weights only: no gathered gradients for it

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self.shadow: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        for name, p in pl_module.named_parameters():
            value = p.detach().float().clone()
            if name not in self.shadow:
                self.shadow[name] = value
            else:
                self.shadow[name].lerp_(value, 1 - self.decay)

    def whole(self) -> dict[str, torch.Tensor]:
        return {name: whole(t) for name, t in self.shadow.items()}


def grad_sq(module: LightningModule) -> float:
    """A user's own gradient statistic: every gradient's squared norm, read as a number, summed."""
    return sum(float(p.grad.norm()) ** 2 for p in module.parameters() if p.grad is not None)


class GradientReader(Callback):
    """A user's own gradient statistic: the sum of every gradient's squared norm, read as a number in
    on_before_optimizer_step and logged (no sync_dist: each rank logs what it read)."""

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        total = grad_sq(pl_module)
        pl_module.log("user/grad_sq", total, on_step=True)


class GradientReaderAfterStep(Callback):
    """The same statistic read after the step (until the next zero_grad one process still holds them)."""

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        total = grad_sq(pl_module)
        pl_module.log("user/grad_sq_after_step", total, on_step=True)


class GradientReaderAfterBackward(Callback):
    """The same statistic read in on_after_backward (where Lightning's docs log gradient histograms)."""

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        total = grad_sq(pl_module)
        pl_module.log("user/grad_sq_after_backward", total, on_step=True)


# by the names scenarios give (``Scenario.callbacks``)
CALLBACKS: dict[str, Callable[[], Callback]] = {
    "finetune": Finetune,
    "add_group": AddParamGroup,
    "freeze_mid": FreezeMidRun,
    "swa": lambda: StochasticWeightAveraging(swa_lrs=5e-3, swa_epoch_start=1, annealing_epochs=1),
    "ema": EMA,
    "read_grads": GradientReader,
    "read_grads_after": GradientReaderAfterStep,
    "read_grads_backward": GradientReaderAfterBackward,
}


def make_callbacks(names: tuple[str, ...]) -> list[Callback]:
    unknown = [name for name in names if name not in CALLBACKS]
    if unknown:
        raise ValueError(f"unknown callback {unknown[0]!r}")
    return [CALLBACKS[name]() for name in names]
