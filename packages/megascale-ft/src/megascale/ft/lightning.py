"""Fault tolerance inside Lightning's ``Trainer``: heartbeats, NaN detection, two-stage checkpoints, exact resume.

    ft = FaultTolerance("s3://bucket/run1/ft", every_n_steps=100, storage_options={...})
    trainer = Trainer(strategy=DDPStrategy(timeout=ft.collective_timeout), callbacks=[ft], ...)
    trainer.fit(model, datamodule=data)  # continues from the newest intact checkpoint under dirpath, if any

Run the script under ``megascale-ft launch``: every rank then sends heartbeats with its steps, losses and
timings, reports a NaN/inf loss (and raises `NonFiniteLossError`), an exception in any hook and a clean end,
and each restart resumes where the last committed checkpoint left off. Outside the launcher the heartbeats
are inert; checkpoints and resume work the same.

Scope: the callback only. Storage, commit and the choice of the latest intact checkpoint are
`TwoStageCheckpointer`'s; the heartbeats are `Executor`'s.

Design choices:

- **What is saved** (one `TwoStageCheckpointer` step): the model and optimizer states as
  ``torch.distributed.checkpoint`` state dicts (``get_model_state_dict``/``get_optimizer_state_dict`` with
  parameter-name keys, so DDP replicas and DTensor shards both work; a strategy with a
  ``sharded_state_dict()``/``load_sharded_state_dict()`` pair, such as megascale's ``MegaScaleStrategy``,
  provides them itself); Lightning's own checkpoint dict without
  weights (loops, callbacks, LR schedulers, precision plugin, datamodule: ``dump_checkpoint()``), as JSON;
  and each rank's random number generators under a rank-specific key.
- **Lightning's state as JSON**: `TwoStageCheckpointer` keeps non-tensor values as JSON (it never unpickles).
  Small tensors in it (a ModelCheckpoint's best score) become tagged lists and come back as tensors;
  hyper-parameters are dropped (the restarted script constructs the module and datamodule again, and
  Lightning does not restore them on resume); anything else that is not JSON-able is refused, naming its key.
- **When**: Lightning's state is captured where ModelCheckpoint saves, at the end of the training batch
  whose optimizer step reached a multiple of ``every_n_steps``, so Lightning's own "saved on train batch
  end" restart logic applies. The snapshot itself (stage 1) is taken at the start of the next training batch
  (or at the end of training, with the RNG states of that moment): the weights are unchanged by then, and
  the RNG states are those the next step starts from, after whatever the data pipeline (a new epoch's
  iterator) or validation drew in between, which is what a resumed run must continue from (it restores
  them at the same point, after creating its own data iterator).
- **Resume** in ``on_fit_start``: the first hook after the strategy has set up the model (wrapped,
  sharded) and built the optimizers, and before Lightning restores the training state. DCP loads in place,
  so it needs exactly those objects: Lightning's ``ckpt_path`` route loads a DDP checkpoint before the
  optimizers exist and expects the whole state in memory. The tensors are loaded in place; the rest is
  handed to Lightning's own checkpoint connector, which restores loops, LR schedulers, precision plugin,
  callbacks and datamodule as it would from a ``ckpt_path``.
- Supported strategies: single device, DDP, and strategies providing the hook pair above (MegaScaleStrategy in
  every layout: tp, pp, dp with ZeRO 0–3). Others (FSDP, DeepSpeed, XLA, ModelParallelStrategy) save and load
  through their own checkpoint engines and are refused.
- **How a rank loads** (`_load_layout`): where ranks hold different entries (pipeline stages, ZeRO-1
  optimizer states by owner under ``zero1_sharding="parameters"``, or a strategy whose layout is unknown
  here) each loads only its own (``partial``). Where a group of ranks holds identical state (DDP: the world;
  MegaScaleStrategy with ZeRO-0 or ZeRO-1, whose checkpoints hold the optimizer state whole: the dp group,
  which lies within one pipeline stage and tp rank) one of them reads and broadcasts to the rest
  (``replicas``). A strategy tells both through ``checkpoint_layout()``; RNG states are per rank, and
  each rank reads its own.
- Exactness: a resumed run matches an uninterrupted one bit for bit when the data pipeline resumes exactly
  (a stateful datamodule or dataloader) and the world size is the same (with another world size the
  weights reshard, but the per-rank RNG streams cannot be carried over, and are not restored).
"""

from __future__ import annotations

import inspect
import os
import random
import time
import warnings
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    SingleDeviceStrategy,
    Strategy,
    XLAStrategy,
)
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from megascale.ft.checkpoint import CheckpointError, TwoStageCheckpointer
from megascale.ft.config import Timeouts
from megascale.ft.executor import ENV, Executor
from megascale.ft.restore import LoadStats
from megascale.ft.timing import microbatch_section

__all__ = ["FaultTolerance"]

# Lightning checkpoint entries not saved: weights go through DCP; hyper-parameters are constructor arguments.
_DROPPED = {
    "state_dict",
    "optimizer_states",
    LightningModule.CHECKPOINT_HYPER_PARAMS_KEY,
    LightningModule.CHECKPOINT_HYPER_PARAMS_NAME,
    LightningModule.CHECKPOINT_HYPER_PARAMS_TYPE,
    LightningDataModule.CHECKPOINT_HYPER_PARAMS_KEY,
    LightningDataModule.CHECKPOINT_HYPER_PARAMS_NAME,
    LightningDataModule.CHECKPOINT_HYPER_PARAMS_TYPE,
}
_TENSOR_TAG = "__megascale_ft_tensor__"


class FaultTolerance(Callback):
    """Heartbeats, NaN/inf detection and two-stage checkpoints with exact resume, as a Lightning callback.

    Args:
        dirpath: checkpoint root (local path or fsspec URL, e.g. ``s3://bucket/run1/ft``) that every rank
            sees; `TwoStageCheckpointer` keeps ``step-*/`` directories there.
        every_n_steps: checkpoint every this many optimizer steps.
        keep_last: committed checkpoints to keep.
        storage_options: fsspec options for ``dirpath`` (``endpoint_url``, ``key``, ``secret``, ...).

    At the start of ``fit`` the newest intact checkpoint under ``dirpath`` (partial and corrupt ones are
    skipped) is restored and training continues at its step; `restored_step` says which. Do not also pass
    ``fit(ckpt_path=...)`` with a strategy that restores after setup (``MegaScaleStrategy``): it would
    overwrite the restored weights, and is refused. Put this callback after callbacks whose state changes in
    ``on_train_batch_end`` (their state is captured as this callback sees it).
    """

    saves_on_stop = True  # MegaScaleStrategy's SIGTERM stop leaves the checkpoint to this callback

    def __init__(
        self,
        dirpath: str,
        every_n_steps: int = 100,
        keep_last: int = 3,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.dirpath = str(dirpath)
        self.every_n_steps = every_n_steps
        self.keep_last = keep_last
        self.storage_options = dict(storage_options or {})
        self.executor: Executor | None = None  # created in setup, once the strategy has chosen the device
        self.checkpointer: TwoStageCheckpointer | None = None
        self.restored_step: int | None = None
        """The step the last ``fit`` resumed from, or None when it started from scratch."""
        # (step, Lightning's state) captured at a checkpoint step's end, awaiting its snapshot
        self._capture: tuple[int, dict[str, Any]] | None = None
        self._rng_to_restore: dict[str, Any] | None = None
        self._step: tuple[int, AbstractContextManager[None]] | None = None  # the optimizer step being timed
        self._fetch: tuple[float, float] | None = None  # (wall, perf_counter) when the last batch ended
        self._section: AbstractContextManager[None] | None = None
        self._losses: list[torch.Tensor] = []
        self.restore_stats: LoadStats | None = None
        """What restoring `restored_step` read from storage on this rank (None: nothing was restored)."""

    @property
    def collective_timeout(self) -> timedelta:
        """The launcher's collective timeout (300 s outside it): give it to the strategy
        (``DDPStrategy(timeout=...)``), so the driver names a hung rank before its peers' collectives fail."""
        seconds = os.environ.get(ENV["collective_timeout"], Timeouts().collective_timeout)
        return timedelta(seconds=float(seconds))

    # --- setup and resume ---------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.executor = Executor.from_env().start()  # first, so that a refusal below is reported too
        _check_strategy(trainer.strategy)
        if self.checkpointer is None:  # collective: every rank creates the checkpointer's side group
            self.checkpointer = TwoStageCheckpointer(
                self.dirpath, keep_last=self.keep_last, storage_options=self.storage_options
            )
        self.restored_step = self.restore_stats = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        assert self.checkpointer is not None
        set_wait_timer = getattr(trainer.strategy, "set_wait_timer", None)
        if callable(set_wait_timer) and self.executor is not None:
            # waits for other ranks inside a step (MegaScaleStrategy's gradient reductions, parameter
            # gathers, pipeline receives, tensor-parallel collectives) become "wait/<kind>" sections:
            # compute = step - waits then names a slow rank
            timer = self.executor.timer

            def waits(kind: str) -> AbstractContextManager[None]:
                return timer.section(f"wait/{kind}")

            def microbatches(kind: str, microbatch: int, stage: int) -> AbstractContextManager[None]:
                return timer.section(microbatch_section(kind, microbatch, stage))

            if "compute" in inspect.signature(set_wait_timer).parameters:
                # and each pipeline microbatch's forward / backward a "pipeline/F3@s0" section (computing,
                # not waiting), for the timeline's bars per microbatch and stage
                set_wait_timer(waits, compute=microbatches)
            else:
                set_wait_timer(waits)
        coords = _parallel_coords(trainer.strategy)
        if coords and self.executor is not None:
            self.executor.set_coords(coords)  # the driver's timeline groups rows by (pp, tp, dp)
        step = self.checkpointer.latest()
        if step is not None:
            self._restore(trainer, pl_module, step)

    def _restore(self, trainer: Trainer, pl_module: LightningModule, step: int) -> None:
        assert self.checkpointer is not None
        strategy = trainer.strategy
        state: dict[str, Any] = {"weights": _weights(trainer), "lightning": {}}
        rng_key = f"rng_rank{trainer.global_rank}"
        saved_world = strategy.broadcast(self._saved_world_size(step) if trainer.is_global_zero else None)
        if saved_world == trainer.world_size:
            state[rng_key] = _rng_state(strategy)
        else:
            warnings.warn(
                f"FaultTolerance: the checkpoint of step {step} was written by {saved_world} ranks, this run "
                f"has {trainer.world_size}: weights and training state are resharded, but the per-rank "
                "random number generators are not restored, so the run will not repeat bit for bit",
                stacklevel=2,
            )
        partial, replicas = _load_layout(strategy)
        self.checkpointer.load(state, step, replicas=replicas, partial=partial, per_rank=[rng_key])
        self.restore_stats = self.checkpointer.last_load
        _load_weights(trainer, state["weights"])
        self._rng_to_restore = state.get(rng_key)  # set at the first batch, after the data iterator exists
        checkpoint = _from_json(state["lightning"])
        if strategy.lightning_restore_optimizer:  # Lightning reloads these: the states just loaded
            checkpoint["optimizer_states"] = [strategy.optimizer_state(o) for o in trainer.optimizers]
        # Lightning's own restore path from here: restore_training_state() (precision plugin, loops,
        # optimizers, LR schedulers) runs right after this hook and reads the connector's checkpoint.
        connector = trainer._checkpoint_connector
        connector._loaded_checkpoint = checkpoint
        if not strategy.restore_checkpoint_after_setup:
            # Lightning restored modules and callbacks before setup already (from nothing); strategies that
            # restore after setup do it themselves right after this hook
            pl_module.on_load_checkpoint(checkpoint)
            connector.restore_datamodule()
            connector.restore_callbacks()
        self.restored_step = step
        rank_zero_info(f"FaultTolerance: resumed from step {step} under {self.dirpath}")

    def _saved_world_size(self, step: int) -> int | None:
        assert self.checkpointer is not None
        try:
            return self.checkpointer.manifest(step).world_size
        except CheckpointError:  # only decides whether RNG states are restored; load() reports real problems
            return None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if (
            self.restored_step is not None
            and trainer.ckpt_path
            and trainer.strategy.restore_checkpoint_after_setup
        ):
            raise RuntimeError(
                f"FaultTolerance restored step {self.restored_step} from {self.dirpath}, and then "
                f"fit(ckpt_path={trainer.ckpt_path!r}) loaded over it: drop ckpt_path (FaultTolerance "
                "resumes by itself), or start from a fresh dirpath"
            )

    # --- per batch ----------------------------------------------------------------------------------------
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._rng_to_restore is not None:
            _set_rng_state(self._rng_to_restore, trainer.strategy)
            self._rng_to_restore = None
        if self._fetch is not None and self.executor is not None:
            # the loader's time for this batch: inside a step (gradient accumulation) it is a wait; between
            # steps it lies outside both and is only drawn (the straggler maths clips waits to the step)
            start, t0 = self._fetch
            self.executor.timer.record("data", trainer.global_step, start, time.perf_counter() - t0)
        self._fetch = None
        if self._capture is not None:
            self._snapshot(trainer)
        if self._step is None:
            assert self.executor is not None
            timed = self.executor.timer.step(trainer.global_step)
            timed.__enter__()
            self._step = (trainer.global_step, timed)
            self._losses = []
        self._enter("forward")

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self._enter("backward")

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._leave()

    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self._enter("optimizer")  # ends at the batch's end: Lightning has no hook after the step

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._leave()
        loss = _loss_of(outputs)
        if loss is not None:
            self._losses.append(loss)
        if self._step is None or trainer.global_step == self._step[0]:
            self._fetch = (time.time(), time.perf_counter())  # the next micro-batch is fetched from here
            return  # accumulating gradients: the optimizer step is not over
        step = self._step[0]
        self._close_step()
        self._fetch = (time.time(), time.perf_counter())  # after the step: the fetch lies between steps
        # Lightning divides each micro-batch's loss by the accumulation count: their sum is the step's mean
        value = float(torch.stack(self._losses).sum()) if self._losses else None
        self._losses = []
        assert self.executor is not None
        self.executor.step_done(step, value)  # raises NonFiniteLossError on NaN/inf, after reporting it
        # MegaScaleStrategy's SIGTERM stop (``PreemptionStop.stop_step``, decided in the same hook before this
        # one) ends the run at this step: snapshot it (in on_train_end), so the run resumes where it stopped
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
        stops = any(getattr(cb, "stop_step", None) == trainer.global_step for cb in callbacks)
        if trainer.global_step % self.every_n_steps == 0 or stops:
            self._capture = (trainer.global_step, _lightning_state(trainer))
        if stops or trainer.should_stop or 0 < trainer.max_steps <= trainer.global_step:
            # the last step: the final commit, other callbacks' end (a sample) and teardown follow, without steps
            self.executor.finishing()

    def _snapshot(self, trainer: Trainer) -> None:
        """Stage 1 of the captured checkpoint, with this moment's weights and RNG states; stage 2 runs on."""
        assert self._capture is not None and self.checkpointer is not None and self.executor is not None
        step, lightning_state = self._capture
        self._capture = None
        state = {
            "weights": _weights(trainer),
            "lightning": lightning_state,
            f"rng_rank{trainer.global_rank}": _rng_state(trainer.strategy),
        }
        with self.executor.timer.section("checkpoint"):
            self.checkpointer.save(step, state)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._fetch = None  # validation, not the loader, fills the gap before the next training batch

    def on_validation_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        if self.executor is not None:
            self.executor.touch()  # validation between two steps is progress, not a hang

    # --- ends -----------------------------------------------------------------------------------------------
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close_step()
        if self.executor is not None:
            self.executor.finishing()  # also when the run ends by epochs
        if self._capture is not None:  # the last step was a checkpoint step: no next batch will come
            self._snapshot(trainer)
        if self.checkpointer is not None:
            self.checkpointer.wait()  # committed before the run reports a clean end

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.executor is not None:
            self.executor.finish()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit" and self.checkpointer is not None:
            self.checkpointer.close()
            self.checkpointer = None

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._close_step()
        self._capture = None
        if self.executor is None:
            return
        if not isinstance(exception, KeyboardInterrupt | SystemExit):
            self.executor.report_exception(exception)
        self.executor.close()
        # the checkpointer is left alone: a save in flight may wait on a dead peer, and the process ends

    # --- timing ---------------------------------------------------------------------------------------------
    def _enter(self, name: str) -> None:
        self._leave()
        if self.executor is not None and self._step is not None:
            section = self.executor.timer.section(name)
            section.__enter__()
            self._section = section

    def _leave(self) -> None:
        section, self._section = self._section, None
        if section is not None:
            section.__exit__(None, None, None)

    def _close_step(self) -> None:
        self._leave()
        step, self._step = self._step, None
        if step is not None:
            step[1].__exit__(None, None, None)


# --- strategies -------------------------------------------------------------------------------------------
def _has_hooks(strategy: Strategy) -> bool:
    return callable(getattr(strategy, "sharded_state_dict", None)) and callable(
        getattr(strategy, "load_sharded_state_dict", None)
    )


def _check_strategy(strategy: Strategy) -> None:
    if _has_hooks(strategy):
        return
    plain = isinstance(strategy, SingleDeviceStrategy | DDPStrategy)
    if not plain or isinstance(strategy, DeepSpeedStrategy | XLAStrategy):
        raise ValueError(
            f"FaultTolerance does not support {type(strategy).__name__}: it checkpoints single-device, DDP "
            "and megascale's MegaScaleStrategy runs (or any strategy with sharded_state_dict() and "
            "load_sharded_state_dict()); use ModelCheckpoint with this strategy's own checkpoint format"
        )


def _parallel_coords(strategy: Any) -> dict[str, int] | None:
    """This rank's coordinate on each named dimension of the strategy's device mesh (MegaScaleStrategy:
    dp, pp, tp), or None."""
    try:
        mesh = getattr(strategy, "device_mesh", None)
    except RuntimeError:  # a strategy whose mesh is not set up
        return None
    names = getattr(mesh, "mesh_dim_names", None)
    coordinate = mesh.get_coordinate() if mesh is not None and names else None
    return dict(zip(names, coordinate)) if names and coordinate is not None else None


def _load_layout(strategy: Strategy) -> tuple[bool, dist.ProcessGroup | None]:
    """``(partial, replicas)`` for `TwoStageCheckpointer.load` on this rank.

    partial: whether the ranks hold different entries. replicas: the group of ranks holding exactly this
    rank's model and optimizer state, or None. A strategy with the hook pair says so through its
    ``checkpoint_layout()`` (an object with ``partial`` and ``replicas``, as MegaScaleStrategy's); one without
    it is taken to be partial, each rank loading its own entries.
    """
    if not _has_hooks(strategy):
        if isinstance(strategy, DDPStrategy) and strategy.world_size > 1:
            return False, dist.group.WORLD  # DDP replicates the model and steps identical optimizers
        return False, None
    layout_of = getattr(strategy, "checkpoint_layout", None)
    if not callable(layout_of):
        return True, None  # a strategy of its own: nothing known about which ranks hold what
    layout = layout_of()
    return bool(layout.partial), layout.replicas


def _weights(trainer: Trainer) -> dict[str, Any]:
    """Model and optimizer states as DCP state dicts, tensors shared with the live ones (loaded in place)."""
    strategy = trainer.strategy
    if _has_hooks(strategy):
        return dict(strategy.sharded_state_dict())  # type: ignore[attr-defined]
    module = trainer.lightning_module
    # flattened: param-group settings keyed by parameter name, like the states (no per-rank lists)
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    state: dict[str, Any] = {"model": get_model_state_dict(module)}
    for i, optimizer in enumerate(trainer.optimizers):
        state[f"optimizer_{i}"] = get_optimizer_state_dict(module, optimizer, options=options)
    return state


def _load_weights(trainer: Trainer, state: dict[str, Any]) -> None:
    strategy = trainer.strategy
    if _has_hooks(strategy):
        strategy.load_sharded_state_dict(state)  # type: ignore[attr-defined]
        return
    module = trainer.lightning_module
    set_model_state_dict(module, state["model"], options=StateDictOptions(strict=module.strict_loading))
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    for i, optimizer in enumerate(trainer.optimizers):
        set_optimizer_state_dict(module, optimizer, state[f"optimizer_{i}"], options=options)


# --- Lightning's state as JSON ----------------------------------------------------------------------------
def _lightning_state(trainer: Trainer) -> dict[str, Any]:
    """Lightning's checkpoint dict without weights and hyper-parameters, JSON-able (a copy)."""
    checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    return {k: _to_json(v, k) for k, v in checkpoint.items() if k not in _DROPPED}


def _to_json(value: Any, path: str) -> Any:
    if isinstance(value, torch.Tensor):
        if value.is_complex() or type(value) is not torch.Tensor:
            raise TypeError(f"Lightning checkpoint entry {path} is a {type(value).__name__} of {value.dtype}, "
                            "which FaultTolerance cannot keep as JSON: keep a plain real tensor there")  # fmt: skip
        data = value.detach().cpu()
        return {_TENSOR_TAG: {"dtype": str(data.dtype).removeprefix("torch."), "shape": list(data.shape),
                              "data": data.flatten().tolist()}}  # fmt: skip
    if value is None or type(value) in (bool, int, float, str):
        return value
    if isinstance(value, bool | int | float | str):  # subclasses (IntEnum, numpy float64) as the base type
        base = next(t for t in (bool, int, float, str) if isinstance(value, t))
        return base(value) if base is not str else str.__str__(value)
    if type(value).__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return value.item()  # a numpy scalar
    if isinstance(value, dict):
        return {k: _to_json(v, f"{path}.{k}") for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_to_json(v, f"{path}.{i}") for i, v in enumerate(value))
    raise TypeError(
        f"Lightning checkpoint entry {path} is a {type(value).__module__}.{type(value).__qualname__}, which "
        "FaultTolerance cannot store: it keeps Lightning's state as JSON (numbers, strings, lists, dicts, small "
        "tensors). Return such values from state_dict()/on_save_checkpoint as those types"
    )


def _from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {_TENSOR_TAG}:
            spec = value[_TENSOR_TAG]
            return torch.tensor(spec["data"], dtype=getattr(torch, spec["dtype"])).reshape(spec["shape"])
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_from_json(v) for v in value)
    return value


# --- random number generators -----------------------------------------------------------------------------
def _rng_state(strategy: Any = None) -> dict[str, Any]:
    """This rank's generators, as tensors (DCP, read back by this rank only) and a few numbers; with a strategy
    that keeps model-parallel dropout streams (MegaScaleStrategy under tp/pp), those too."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
    }
    streams = getattr(strategy, "random_streams_state", None)
    model_parallel = streams() if callable(streams) else None
    if model_parallel is not None:
        state["model_parallel"] = model_parallel
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    try:
        import numpy as np
    except ImportError:
        return state
    name, key, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    state["numpy"] = {
        "name": str(name), "key": torch.from_numpy(np.asarray(key, dtype=np.int64)), "pos": int(pos),
        "has_gauss": int(has_gauss), "gauss": float(cached),
    }  # fmt: skip
    return state


def _set_rng_state(state: dict[str, Any], strategy: Any = None) -> None:
    torch.set_rng_state(state["torch"])
    if "model_parallel" in state:
        strategy.load_random_streams_state(state["model_parallel"])
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss"]))
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        saved = state["numpy"]
        key = saved["key"].numpy().astype(np.uint32)
        np.random.set_state((saved["name"], key, saved["pos"], saved["has_gauss"], saved["gauss"]))


def _loss_of(outputs: Any) -> torch.Tensor | None:
    """The training step's loss (detached, whole even when a DTensor), or None."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if not isinstance(loss, torch.Tensor):
        return None
    full = getattr(loss, "full_tensor", None)  # a DTensor loss: every rank calls this, in the same order
    return (full() if callable(full) else loss).detach().float().mean()
