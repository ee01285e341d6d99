"""SIGTERM during ``fit`` (``timeout``, SLURM preemption, ``docker stop``, Kubernetes): finish the step, save a
checkpoint, exit 0.

Lightning 2.6's own SIGTERM handler issues a ``dist.broadcast`` from inside the signal handler, i.e. in the
middle of whatever collective the rank was running, and every rank then blocks until the collective timeout
(30 minutes by default). Under MegaScaleStrategy that handler is replaced while ``fit`` runs:

- the handler only records the signal (no collectives, no I/O but one line); in the process that launched
  the other ranks (Lightning's own launcher: ``megascale fit`` with ``devices > 1``) it also forwards the
  signal to them, so a signal that reaches only that process stops them too;
- at the end of every training batch that ran an optimizer step, all ranks agree on the flag with one
  1-element all-reduce (MAX) over the whole world, so a signal that reached any rank (one, some, or all of
  them) stops all of them at the same step, whatever the layout (tp, pp, dp: every rank runs this hook at the
  same point of the loop);
- if it is set, the run saves a checkpoint through ``trainer.save_checkpoint`` (the strategy's sharded
  checkpoint) as ``last-preempted.ckpt`` in the first ModelCheckpoint's directory (else
  ``default_root_dir/checkpoints``), logs where it is and how to resume, skips validation and stops: ``fit``
  returns normally and the process exits 0. A callback that saves its own checkpoints on a stop (megascale-ft's
  ``FaultTolerance``, ``saves_on_stop = True``) writes them instead.

Bound: from the signal to the exit, the rest of the current optimizer step (all of its gradient-accumulation
batches), a validation run if one is under way when the signal comes, and one checkpoint write.

Lightning's ``received_sigterm`` stays False, so its per-batch broadcast and ``SIGTERMException`` never fire.
Lightning's original handlers (and any handler the user had before ``fit``, which is not called during ``fit``)
are restored at teardown. A second
SIGTERM is ignored (a forwarded signal may arrive twice); SIGKILL, which schedulers send after their grace
period, still ends the process.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

__all__ = ["PREEMPTED_NAME", "PreemptionStop", "install"]

# named "last*": what fit(ckpt_path="last") looks for in each ModelCheckpoint's directory
PREEMPTED_NAME = "last-preempted.ckpt"


class _RecordingSignalConnector(_SignalConnector):
    """Lightning's signal connector with SIGTERM recorded instead of acted on (SIGUSR1/SLURM requeue kept)."""

    def __init__(self, trainer: Trainer, stop: PreemptionStop) -> None:
        super().__init__(trainer)
        self._stop = stop

    def register_signal_handlers(self) -> None:
        super().register_signal_handlers()  # also remembers every handler as it was, for teardown
        self._register_signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if self._stop.requested:
            return
        self._stop.requested = True
        sys.stderr.write(
            f"[rank {self.trainer.global_rank}] SIGTERM: finishing this step, then saving a checkpoint and exiting\n"
        )
        launcher = self.trainer.strategy.launcher
        if isinstance(launcher, _SubprocessScriptLauncher):
            launcher.kill(signum)  # the ranks this process started (a signal sent to the launcher only)


class PreemptionStop(Callback):
    """Agrees on a pending SIGTERM after every optimizer step and then saves and stops (see the module)."""

    # ZeRO-1 need not wait for the parameters after every step for this callback: it reads none itself, and
    # the strategy's save_checkpoint waits for them first (weight_readers.py)
    reads_weights_between_steps = False

    def __init__(self) -> None:
        self.requested = False  # this rank received SIGTERM (set by the handler)
        # the step all ranks agreed to stop after (callbacks with ``saves_on_stop`` read it)
        self.stop_step: int | None = None
        self.saved_to: Path | None = None
        self._restore: tuple[Any, Any, Any] | None = None  # what the stop changed on the trainer

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.stop_step is not None or trainer.fit_loop._should_accumulate():
            return  # stop between optimizer steps only: a checkpoint mid-accumulation would lose gradients
        flag = torch.tensor([1.0 if self.requested else 0.0], device=trainer.strategy.root_device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # the default group: every rank of every layout
        if flag.item() == 0:
            return
        self.stop_step = trainer.global_step
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
        savers = [type(cb).__name__ for cb in callbacks if getattr(cb, "saves_on_stop", False)]
        if savers:
            where = f"{' and '.join(savers)} saves the checkpoint of step {trainer.global_step} as it ends"
            resume = "run the same command again"
        else:
            self.saved_to = _checkpoint_dir(trainer) / PREEMPTED_NAME
            trainer.save_checkpoint(self.saved_to)
            where = f"checkpoint of step {trainer.global_step} saved to {self.saved_to}"
            resume = (
                f"resume with --ckpt_path last (fit(ckpt_path='last')) or --ckpt_path {self.saved_to}"
                if trainer.checkpoint_callback is not None
                else f"resume with --ckpt_path {self.saved_to}"
            )
        rank_zero_info(f"MegaScaleStrategy: stopping on SIGTERM: {where}; {resume}")
        # should_stop would otherwise run a validation before the loop ends, and min_epochs/min_steps veto it;
        # all three are put back in on_train_end, for a validate() after fit
        loop = trainer.fit_loop
        self._restore = (trainer.limit_val_batches, loop.min_epochs, loop.epoch_loop.min_steps)
        trainer.limit_val_batches, loop.min_epochs, loop.epoch_loop.min_steps = 0, None, None
        trainer.should_stop = True

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._restore is not None:
            loop = trainer.fit_loop
            trainer.limit_val_batches, loop.min_epochs, loop.epoch_loop.min_steps = self._restore
            self._restore = None


def _checkpoint_dir(trainer: Trainer) -> Path:
    callback = trainer.checkpoint_callback  # the first ModelCheckpoint: where ckpt_path="last" looks
    dirpath = getattr(callback, "dirpath", None)
    return Path(dirpath) if dirpath else Path(trainer.default_root_dir) / "checkpoints"


def install(trainer: Trainer) -> PreemptionStop | None:
    """Called in ``Strategy.setup``, before the trainer registers its signal handlers: for ``fit``, ours
    replace Lightning's SIGTERM handler; for validate/test/predict (no step to finish), Lightning's stay.

    The stop callback goes first, so callbacks after it (ModelCheckpoint, FaultTolerance) see the decision in
    the same ``on_train_batch_end``."""
    given: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
    callbacks = [cb for cb in given if not isinstance(cb, PreemptionStop)]
    if trainer.state.fn != TrainerFn.FITTING:
        trainer.callbacks = callbacks  # type: ignore[attr-defined]
        if isinstance(trainer._signal_connector, _RecordingSignalConnector):
            trainer._signal_connector = _SignalConnector(trainer)
        return None
    stop = PreemptionStop()
    trainer.callbacks = [stop, *callbacks]  # type: ignore[attr-defined]
    trainer._signal_connector = _RecordingSignalConnector(trainer, stop)
    return stop
