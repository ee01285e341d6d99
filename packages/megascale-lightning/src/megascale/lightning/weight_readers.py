"""Which user code reads weights between optimizer steps, or gradients before the step.

Weights. ZeRO-1 with ``overlap_param_gather`` sends each rank's updated parameters in the background after the
step, and the next forward waits for them layer by layer, so until then some parameters hold the previous
step's values. That is safe for the forward (and for the LightningModule's training_step, which runs inside
its forward), but not for a callback that reads weights in ``on_train_batch_end``/``_start`` (an EMA of the
weights, say) or ``on_train_epoch_start``/``_end`` (StochasticWeightAveraging), nor for manual optimization, whose training_step steps an optimizer and then
runs another forward (a GAN) inside the same outer forward. Callbacks known to read none are listed here; for
any other that overrides those hooks, and under manual optimization, the strategy waits for the parameters
right after the step instead.

Gradients. ZeRO-1 with ``zero1_sharding="elements"`` leaves each rank only its piece of every gradient after
the reduce-scatter. User code that reads gradients before the step (``grad_norm`` logged in
``on_before_optimizer_step``, its own ``clip_grad_norm_`` in ``configure_gradient_clipping``, anything under
manual optimization) must see them whole, so where such code exists the strategy has them all-reduced instead.
After the step, until the next zero_grad, one process still holds every gradient: code reading them then
(``on_train_batch_end``/``_start`` of a callback or the LightningModule) must see them whole too.
"""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import (
    BaseFinetuning,
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    ProgressBar,
    ThroughputMonitor,
    Timer,
)
from lightning.pytorch.utilities.model_helpers import is_overridden

__all__ = [
    "gradient_readers",
    "gradient_readers_after_backward",
    "gradient_readers_after_step",
    "gradient_readers_before_step",
    "manual_gradient_reader",
    "weight_readers_between_steps",
]

# StochasticWeightAveraging averages the weights in on_train_epoch_start, right after an epoch's last step
_HOOKS = ("on_train_batch_end", "on_train_batch_start", "on_train_epoch_end", "on_train_epoch_start")
# Read no weights in those hooks (ModelCheckpoint saves through the strategy, which waits first; BaseFinetuning
# only switches requires_grad). A callback of your own that reads none can say so with a class attribute
# ``reads_weights_between_steps = False``.
_KNOWN = (
    BaseFinetuning,
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    ProgressBar,
    ThroughputMonitor,
    Timer,
)
# Where gradients exist and have not been stepped yet. Overrides written in megascale's own packages (GPTModule's
# grad-norm logging, megascale-ft's step timer) read them through the strategy's ``gradient_norm_group`` or not
# at all. A callback (or LightningModule) of your own that reads none, or only that way, can say so with a class
# attribute ``reads_gradients = False``.
_GRADIENT_HOOKS = ("on_after_backward", "on_before_optimizer_step")
_MODULE_GRADIENT_HOOKS = (*_GRADIENT_HOOKS, "configure_gradient_clipping")


def _reads_gradients(obj: object, hooks: tuple[str, ...], base: type) -> bool:
    if not getattr(obj, "reads_gradients", True):
        return False
    return any(
        is_overridden(hook, obj, base)  # type: ignore[arg-type]
        and not getattr(getattr(type(obj), hook), "__module__", "").startswith("megascale.")
        for hook in hooks
    )


def weight_readers_between_steps(trainer: Trainer) -> list[str]:
    """Names of the callbacks (and the LightningModule) whose between-step hooks may read weights, and the
    LightningModule under manual optimization."""
    readers = []
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, _KNOWN) or not getattr(callback, "reads_weights_between_steps", True):
            continue
        if any(is_overridden(hook, callback, Callback) for hook in _HOOKS):
            readers.append(type(callback).__name__)
    module = trainer.lightning_module
    if any(is_overridden(hook, module, LightningModule) for hook in _HOOKS):
        readers.append(type(module).__name__)
    if not module.automatic_optimization:
        readers.append(f"{type(module).__name__} (manual optimization)")
    return readers


def _hook_readers(
    trainer: Trainer, callback_hooks: tuple[str, ...], module_hooks: tuple[str, ...], skip_known: bool = False
) -> list[str]:
    """Names of the callbacks overriding one of ``callback_hooks`` and of the LightningModule overriding one of
    ``module_hooks`` (megascale's own overrides and any saying ``reads_gradients = False`` left out)."""
    readers = [
        type(callback).__name__
        for callback in trainer.callbacks  # type: ignore[attr-defined]
        if not (skip_known and isinstance(callback, _KNOWN))
        and _reads_gradients(callback, callback_hooks, Callback)
    ]
    if _reads_gradients(trainer.lightning_module, module_hooks, LightningModule):
        readers.append(type(trainer.lightning_module).__name__)
    return readers


def gradient_readers(trainer: Trainer) -> list[str]:
    """Names of the callbacks and the LightningModule that may read gradients before the optimizer step: those
    overriding ``on_after_backward`` or ``on_before_optimizer_step`` (the module also
    ``configure_gradient_clipping``), and the LightningModule under manual optimization."""
    if trainer.lightning_module.automatic_optimization:
        return _hook_readers(trainer, _GRADIENT_HOOKS, _MODULE_GRADIENT_HOOKS)
    callbacks = _hook_readers(trainer, _GRADIENT_HOOKS, ())
    return [*callbacks, f"{type(trainer.lightning_module).__name__} (manual optimization)"]


def gradient_readers_after_backward(trainer: Trainer) -> list[str]:
    """Names of the callbacks and the LightningModule overriding ``on_after_backward`` (but megascale's own and
    any saying ``reads_gradients = False``)."""
    return _hook_readers(trainer, ("on_after_backward",), ("on_after_backward",))


def gradient_readers_before_step(trainer: Trainer) -> list[str]:
    """Names of the callbacks overriding ``on_before_optimizer_step`` and of the LightningModule overriding it
    or ``configure_gradient_clipping`` (but megascale's own and any saying ``reads_gradients = False``)."""
    return _hook_readers(
        trainer, ("on_before_optimizer_step",), ("on_before_optimizer_step", "configure_gradient_clipping")
    )


def manual_gradient_reader(trainer: Trainer) -> str | None:
    """The LightningModule's name where its manual training_step may read gradients between
    ``manual_backward`` and the optimizer's step: manual optimization, unless it says ``reads_gradients = False``."""
    module = trainer.lightning_module
    if module.automatic_optimization or not getattr(module, "reads_gradients", True):
        return None
    return f"{type(module).__name__} (manual optimization)"


def gradient_readers_after_step(trainer: Trainer) -> list[str]:
    """Names of the callbacks and the LightningModule (automatic optimization) that may read gradients after
    the optimizer step, before the next zero_grad: those overriding ``on_train_batch_end`` or
    ``on_train_batch_start``, but Lightning's callbacks known to read none, megascale's own, and any saying
    ``reads_gradients = False``. Under manual optimization too: what its optimizer steps leave is read there."""
    hooks = ("on_train_batch_end", "on_train_batch_start")
    return _hook_readers(trainer, hooks, hooks, skip_known=True)
