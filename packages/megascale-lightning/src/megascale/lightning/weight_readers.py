"""Which hooks may read a model's weights between an optimizer step and the next forward.

ZeRO-1 with ``overlap_param_gather`` sends each rank's updated parameters in the background after the step,
and the next forward waits for them layer by layer, so until then some parameters hold the previous step's
values. That is safe for the forward (and for the LightningModule's training_step, which runs inside its
forward), but not for a callback that reads weights in ``on_train_batch_end`` or ``on_train_batch_start`` (an
EMA of the weights, say). Callbacks known to read none are listed here; for any other that overrides those
hooks, the strategy waits for the parameters right after the step instead.
"""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import (
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    ProgressBar,
    ThroughputMonitor,
    Timer,
)
from lightning.pytorch.utilities.model_helpers import is_overridden

__all__ = ["weight_readers_between_steps"]

_HOOKS = ("on_train_batch_end", "on_train_batch_start")
# Read no weights in those hooks (ModelCheckpoint saves through the strategy, which waits first). A callback
# of your own that reads none can say so with a class attribute ``reads_weights_between_steps = False``.
_KNOWN = (
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    ProgressBar,
    ThroughputMonitor,
    Timer,
)


def weight_readers_between_steps(trainer: Trainer) -> list[str]:
    """Names of the callbacks (and the LightningModule) whose between-step hooks may read weights."""
    readers = []
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, _KNOWN) or not getattr(callback, "reads_weights_between_steps", True):
            continue
        if any(is_overridden(hook, callback, Callback) for hook in _HOOKS):
            readers.append(type(callback).__name__)
    module = trainer.lightning_module
    if any(is_overridden(hook, module, LightningModule) for hook in _HOOKS):
        readers.append(type(module).__name__)
    return readers
