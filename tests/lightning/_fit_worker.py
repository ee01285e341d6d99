"""Runs a list of ``Trainer.fit`` jobs in one (possibly torchrun-launched) process group and records them.

    python -m torch.distributed.run --nproc-per-node 4 -m tests.lightning._fit_worker SPEC.json OUT.pt
    python -m tests.lightning._fit_worker SPEC.json OUT.pt          # one process, Lightning's default strategy

SPEC.json: {"jobs": [{"name", "strategy": {MegaScaleStrategy kwargs} | null, "config": {GPTConfig kwargs},
"module": {GPTModule kwargs}, "data": {TokenDataModule kwargs}, "trainer": {Trainer kwargs},
"save_at_end": path | null, "resume_from": path | null, "module_class": "pkg.mod.Class" (optional: any
LightningModule taking **module; then "config" is unused), "probe": true (optional: a callback reading every
weight after each step, as an EMA would), "checkpoint_every": n and "checkpoint_dir": path (optional: a
ModelCheckpoint writing "step=<k>.ckpt" every n steps; "checkpoint_save_last" and "checkpoint_last_name" set its
save_last and CHECKPOINT_NAME_LAST), "optimizer_state": true (optional: record the whole
optimizer state after fit), "save_at_start": path (optional: trainer.save_checkpoint there in on_train_start),
"deepcopy_callbacks": true (optional: copy.deepcopy(trainer.callbacks) after fit, recorded), "best_dir": path
(optional: a ModelCheckpoint keeping the 2 best by val/loss there, then validate/test/predict(ckpt_path="best")
recorded as "best_path", "best_score", "kept", "validated", "tested", "predicted"), "expect_error": true (optional: record the exception fit or the save at its end raises instead of
failing)}, ...]}
OUT.pt (written by global rank 0): {name: {"losses": [per optimizer step, as logged (synced over ranks)],
"weights": {name: full fp32 tensor}, "samples": [per optimizer step, the fingerprints of the union batch of
every rank], "optimizer": {key: full fp32 tensor} (optional), "error": str (with expect_error)}}. Several fits share the process group (Lightning keeps it alive), so
one launch pays the ~5 s of imports once for all the layouts of a world size.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from megascale.core import GPTConfig
from megascale.lightning import GPTModule, MegaScaleStrategy, RunSummary, TokenDataModule
from tests._dist import finish_and_exit


class RecordLoss(Callback):
    """The synced training loss after every optimizer step (what loggers and the progress bar show)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.expert_load: list[float] = []  # GPTModule's moe/load after each step, with a mixture of experts
        self.samples: list[list[int]] = []  # per optimizer step: a fingerprint of each sample this rank saw
        self._step_samples: list[int] = []

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # hash() of a tuple of ints is the same in every process (only str/bytes hashing is salted)
        self._step_samples += [hash(tuple(row)) for row in batch[0].tolist()]
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.samples.append(self._step_samples)
            self._step_samples = []
            self.losses.append(float(trainer.callback_metrics["train/loss"]))
            if "moe/load" in trainer.callback_metrics:
                self.expert_load.append(float(trainer.callback_metrics["moe/load"]))
            if os.environ.get("FIT_DEBUG"):
                print(
                    "DEBUG",
                    trainer.global_rank,
                    batch_idx,
                    float(outputs["loss"]),
                    self.losses[-1],
                    batch[0][:, :4].tolist(),
                    flush=True,
                )


class SaveAtStart(Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        trainer.save_checkpoint(self.path)


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    seed_everything(0, workers=True)
    strategy = MegaScaleStrategy(**job["strategy"]) if job.get("strategy") is not None else "auto"
    if job.get("module_class"):
        module_path, _, class_name = job["module_class"].rpartition(".")
        module = getattr(importlib.import_module(module_path), class_name)(**job.get("module", {}))
    else:
        module = GPTModule(GPTConfig(**job["config"]), **job.get("module", {}))
    data = TokenDataModule(**job["data"])
    record = RecordLoss()
    trainer_kwargs = dict(
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[record],
    )
    summary = RunSummary(**job["summary"]) if job.get("summary") else None
    if summary is not None:
        trainer_kwargs["callbacks"] = [record, summary]
    probe = None
    if job.get("probe"):  # what a weight-reading callback (an EMA) sees after each step
        from tests.lightning._own_modules import WeightProbe

        probe = WeightProbe()
        trainer_kwargs["callbacks"] = [record, probe]
    if job.get("save_at_start"):  # a save before the first optimizer step: it must not change training
        trainer_kwargs["callbacks"] = [*trainer_kwargs["callbacks"], SaveAtStart(job["save_at_start"])]
    if job.get("checkpoint_every"):  # saved during fit, as a run that is later resumed elsewhere saves
        from lightning.pytorch.callbacks import ModelCheckpoint

        every = ModelCheckpoint(dirpath=job["checkpoint_dir"], filename="{step}", every_n_train_steps=job["checkpoint_every"],
                                save_top_k=-1, save_last=job.get("checkpoint_save_last"))  # fmt: skip
        if job.get("checkpoint_last_name"):  # a last checkpoint named anew each time ("last-{step}")
            every.CHECKPOINT_NAME_LAST = job["checkpoint_last_name"]
        trainer_kwargs["callbacks"] = [*trainer_kwargs["callbacks"], every]
        trainer_kwargs["enable_checkpointing"] = True
    best = None
    if job.get("best_dir"):  # top-2 checkpoints by val/loss, then validate/test/predict(ckpt_path="best")
        from lightning.pytorch.callbacks import ModelCheckpoint

        best = ModelCheckpoint(
            dirpath=job["best_dir"],
            filename="{step}",
            monitor="val/loss",
            mode=job.get("best_mode", "min"),
            save_top_k=2,
        )
        trainer_kwargs["callbacks"] = [*trainer_kwargs["callbacks"], best]
        trainer_kwargs["enable_checkpointing"] = True
    trainer_kwargs.update(job.get("trainer", {}))
    trainer = Trainer(**trainer_kwargs)
    try:
        trainer.fit(module, datamodule=data, ckpt_path=job.get("resume_from"))
        if job.get("save_at_end"):
            trainer.save_checkpoint(job["save_at_end"])
    except Exception as error:  # every rank raises (a refusal is collective)
        if not job.get("expect_error"):
            raise
        return {"error": "\n".join([str(error), *getattr(error, "__notes__", [])])}
    after_best: dict[str, Any] = {}
    if best is not None:  # each reads the best checkpoint through the strategy
        after_best["best_path"] = best.best_model_path
        after_best["best_score"] = float(best.best_model_score)
        after_best["kept"] = sorted(os.path.basename(p) for p in best.best_k_models)
        after_best["validated"] = trainer.validate(module, datamodule=data, ckpt_path="best", verbose=False)[
            0
        ]
        after_best["tested"] = trainer.test(
            module, dataloaders=data.val_dataloader(), ckpt_path="best", verbose=False
        )[0]
        predicted = trainer.predict(module, dataloaders=data.val_dataloader(), ckpt_path="best")
        after_best["predicted"] = torch.cat([p.float() for p in predicted]) if predicted else None
    copied_callbacks = None
    if job.get("deepcopy_callbacks"):  # what a sweep or a notebook does with a finished trainer's callbacks
        import copy

        try:
            copied_callbacks = [type(c).__name__ for c in copy.deepcopy(trainer.callbacks)]
        except Exception as error:
            copied_callbacks = [f"error: {error}"]
    options = StateDictOptions(
        full_state_dict=True
    )  # on every rank (cpu_offload would keep it on rank 0 only)
    weights = {k: v.float().clone() for k, v in get_model_state_dict(module, options=options).items()}
    # pipeline ranks hold different layers: the whole model is the union of every rank's
    for part in _gather(weights):
        for key, value in part.items():
            weights.setdefault(key, value)
    out: dict[str, Any] = {"losses": record.losses, "weights": weights, "expert_load": record.expert_load}
    if copied_callbacks is not None:
        out["copied_callbacks"] = copied_callbacks
    out.update(after_best)
    dims = getattr(trainer.strategy, "_dims", None)  # MegaScaleStrategy: the layout it ran
    if dims is not None:
        out["layout"] = {
            "dp": dims.dp,
            "pp": dims.pp,
            "cp": dims.cp,
            "tp": dims.tp,
            "ep": trainer.strategy.ep,
        }
    # the union batch of each step over every rank (tp and pp peers see the same samples)
    out["samples"] = [sorted(set().union(*step)) for step in zip(*_gather(record.samples))]
    if job.get("optimizer_state"):
        out["optimizer"] = _optimizer_state(trainer, module)
    # what every rank saw, not only rank 0 (pipeline stages other than the last must show the same loss)
    out["losses_by_rank"] = _gather(record.losses)
    if "val/loss" in trainer.callback_metrics:
        out["val_loss"] = float(trainer.callback_metrics["val/loss"])
    if probe is not None:
        out["probe_by_rank"] = _gather(probe.sums)
    if summary is not None:  # the end-of-run sample, as every rank generated it
        out["sample"] = _gather(summary.sample)
    if job.get("predict"):  # trainer.predict after fit, on the held-out windows
        predictions = trainer.predict(module, dataloaders=data.val_dataloader())
        out["predicted"] = torch.cat([p.float() for p in predictions]) if predictions else None
    if job.get("generate"):
        prompt = torch.tensor([job["generate"]])
        module.eval()
        out["generated"] = _gather(module.generate(prompt, 6, temperature=0.0)[0].tolist())
    return out


def _optimizer_state(trainer: Trainer, module: Any) -> dict[str, torch.Tensor]:
    """Every optimizer's state and numeric group settings by parameter name, whole (as a checkpoint holds
    them, ZeRO-1's pieces gathered), from the union of every rank's (pipeline stages, ZeRO-1 owners)."""
    from megascale.lightning import checkpoint_io

    if isinstance(trainer.strategy, MegaScaleStrategy):
        state = trainer.strategy.sharded_state_dict()
    else:
        state = checkpoint_io.states(module, trainer.optimizers)
    mine: dict[str, torch.Tensor] = {}
    for i in range(len(trainer.optimizers)):
        for key, value in state[f"optimizer_{i}"].items():
            if isinstance(value, torch.Tensor):  # DTensors gathered: a collective over their mesh, in order
                whole = value.full_tensor() if hasattr(value, "full_tensor") else value
                mine[f"{i}.{key}"] = whole.detach().float().clone()
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                mine[f"{i}.{key}"] = torch.tensor(float(value))
    merged: dict[str, torch.Tensor] = {}
    for part in _gather(mine):
        for key, value in part.items():
            merged.setdefault(key, value)
    return merged


def _gather(value: Any) -> list[Any]:
    if not torch.distributed.is_initialized():
        return [value]
    values: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(values, value)
    return values


def main(spec_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    with open(spec_path) as f:
        spec = json.load(f)
    results = {job["name"]: run_job(job) for job in spec["jobs"]}
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(results, out_path)
    finish_and_exit()


if __name__ == "__main__":
    main(*sys.argv[1:3])
