"""Runs conformance cells: one process (the reference) or the ranks of one launch (the layouts).

    python -m tests.conformance.runner SPEC.json OUT_DIR                       # the reference, one process
    python -m torch.distributed.run --nproc-per-node 2 -m tests.conformance.runner SPEC.json OUT_DIR

(tests/conformance/matrix.py forks the ranks with torchrun's environment instead: tests/lightning/_launch.py.)

SPEC.json: {"jobs": [{"cell", "scenario", "seed", "layout" (None: the one-process reference), "moe" (the
model with mixture-of-experts feed-forwards),
"resume_from" (a checkpoint, or None), "work" (a directory for this cell's checkpoints)}]}. Every job is a
``Trainer.fit`` of ``model.ConformanceModule``; all jobs of a launch share its process group (Lightning keeps
it), so a launch pays the imports once. For each job rank 0 writes ``OUT_DIR/<cell>.pt`` (see ``_record``), and
a rank whose fit raised writes ``OUT_DIR/<cell>.rank<r>.error``. A job that leaves the ranks out of step
(one raised, the others wait in a collective) ends the launch: the cells after it are written as not run.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from tests.conformance.callbacks import EMA, Recorder, make_callbacks, whole
from tests.conformance.model import ConformanceModule
from tests.conformance.scenarios import (
    GLOBAL_BATCH,
    LAYOUT,
    SEQ,
    TRAIN_SEQUENCES,
    VAL_SEQUENCES,
    VOCAB,
    Layout,
    draw_shape,
)
from tests.conformance.scenarios import scenario as scenario_named

COLLECTIVE_TIMEOUT = timedelta(seconds=60)
DATA_SEED = 1234


def datasets(documents: bool = False) -> tuple[TensorDataset, TensorDataset]:
    """``documents``: each sequence packs two documents, cut where the data's generator says; the samples are
    then (inputs, targets, position_ids), the positions restarting at 0 at the second document."""
    g = torch.Generator().manual_seed(DATA_SEED)
    tokens = torch.randint(0, VOCAB, (TRAIN_SEQUENCES + VAL_SEQUENCES, SEQ + 1), generator=g)
    train, val = tokens[:TRAIN_SEQUENCES], tokens[TRAIN_SEQUENCES:]
    if not documents:
        return TensorDataset(train[:, :-1], train[:, 1:]), TensorDataset(val[:, :-1], val[:, 1:])
    cuts = torch.randint(2, SEQ - 1, (len(tokens), 1), generator=g)
    index = torch.arange(SEQ).expand(len(tokens), SEQ)
    positions = torch.where(index < cuts, index, index - cuts)
    return (
        TensorDataset(train[:, :-1], train[:, 1:], positions[:TRAIN_SEQUENCES]),
        TensorDataset(val[:, :-1], val[:, 1:], positions[TRAIN_SEQUENCES:]),
    )


def _loaders(dp: int | None, documents: bool = False) -> tuple[DataLoader, DataLoader]:
    """dp None: the reference, which draws the union batches through the sampler Lightning would inject."""
    train, val = datasets(documents)
    if dp is None:
        sampler = DistributedSampler(train, num_replicas=1, rank=0, shuffle=True, seed=0)
        return DataLoader(train, batch_size=GLOBAL_BATCH, sampler=sampler), DataLoader(val, batch_size=2)
    # Lightning replaces both samplers by DistributedSampler over the dp ranks (shuffled for training)
    return DataLoader(train, batch_size=GLOBAL_BATCH // dp, shuffle=True), DataLoader(val, batch_size=2)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _gather(value: Any) -> list[Any]:
    if not dist.is_initialized():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _union(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pipeline ranks hold different layers: the whole is the union of every rank's."""
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for key, value in part.items():
            out.setdefault(key, value)
    return out


_MESHES: dict[tuple[int, int, int, int], Any] = {}


def _mesh(layout: Layout) -> Any:
    """One mesh per layout for the whole launch: each new mesh opens process groups that stay open."""
    from megascale.core.parallel.mesh import ParallelDims

    key = (layout.dp, layout.pp, layout.tp, layout.cp)
    if key not in _MESHES:
        _MESHES[key] = ParallelDims(*key).build_mesh("cpu")
    return _MESHES[key]


class StopAfterFirstEpoch(Callback):
    """Ends the fit at the first epoch's end, as a run killed there would (its checkpoint just written)."""

    reads_weights_between_steps = False
    reads_gradients = False

    def on_train_epoch_end(self, trainer: Trainer, pl_module: Any) -> None:
        trainer.should_stop = True


def _fit(job: dict[str, Any], resume_from: str | None, stop_early: bool) -> dict[str, Any]:
    """One ``Trainer.fit`` of the job's scenario (from ``resume_from``, or stopped after the first epoch)."""
    scenario = scenario_named(job["scenario"])
    layout = LAYOUT[job["layout"]] if job["layout"] else None
    work = Path(job["work"])
    seed_everything(0, verbose=False)
    features = {**scenario.features, "moe": True} if job.get("moe") else scenario.features
    module = ConformanceModule(draw_shape(job["seed"], scenario.shape_of or scenario.name), features)
    recorder = Recorder()
    callbacks = [recorder, *make_callbacks(scenario.callbacks)]
    saves = scenario.saves or scenario.resumes
    if saves:
        callbacks.append(ModelCheckpoint(dirpath=work / "epochs", filename="{epoch}", every_n_epochs=1,
                                         save_top_k=-1, save_on_train_epoch_end=True))  # fmt: skip
    if stop_early:
        callbacks.append(StopAfterFirstEpoch())
    if layout is None:
        strategy: Any = "auto"
    else:
        from megascale.lightning import MegaScaleStrategy

        strategy = MegaScaleStrategy(
            **{**layout.strategy, **scenario.strategy}, timeout=COLLECTIVE_TIMEOUT, device_mesh=_mesh(layout)
        )
    flags: dict[str, Any] = dict(max_epochs=2)
    flags.update(scenario.trainer)
    if not scenario.validate:
        flags["limit_val_batches"] = 0
    trainer = Trainer(
        accelerator="cpu", devices=layout.world if layout else 1, strategy=strategy, logger=False,
        enable_checkpointing=saves, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, precision="bf16-mixed" if scenario.bf16 else "32-true", callbacks=callbacks,
        **flags,
    )  # fmt: skip
    train, val = _loaders(layout.dp if layout else None, bool(features.get("documents")))
    init = None
    if layout is None and resume_from is None:  # one process: the initial weights, the updates' origin
        module.configure_model()
        init = {n: p.detach().float().clone() for n, p in module.named_parameters()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, train_dataloaders=train, val_dataloaders=val, ckpt_path=resume_from)
    return dict(trainer=trainer, module=module, recorder=recorder, callbacks=callbacks, init=init,
                warned=[str(w.message) for w in caught])  # fmt: skip


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    scenario = scenario_named(job["scenario"])
    work = Path(job["work"])
    if scenario.resumes and not job.get(
        "resume_from"
    ):  # killed at the first epoch's end, resumed by a new Trainer
        first = _fit(job, None, stop_early=True)
        fit = _fit(job, str(work / "epochs" / "epoch=0.ckpt"), stop_early=False)
        fit["recorder"].steps[:0] = first["recorder"].steps
        fit["recorder"].validations[:0] = first["recorder"].validations
        fit["warned"] += first["warned"]
        fit["init"] = first["init"]
    else:
        fit = _fit(job, job.get("resume_from"), stop_early=False)
    result = _record(fit["trainer"], fit["module"], fit["recorder"], fit["callbacks"], work, fit["warned"])
    if scenario.strategy.get("save_distributed_checkpoint") is False:  # what Lightning's readers take
        written = [work / "end.ckpt", *sorted((work / "epochs").iterdir())]
        if not all(path.is_file() for path in written):
            raise AssertionError(f"not one file each: {[p.name for p in written if not p.is_file()]}")
    if fit["init"] is not None:
        result["init"] = fit["init"]
    return result


def _record(trainer: Trainer, module: ConformanceModule, recorder: Recorder, callbacks: list[Any], work: Path,
            warned: list[str]) -> dict[str, Any]:  # fmt: skip
    """What one process would be compared on: every logged metric, whole weights and EMA, the checkpoint
    saved at the end (model and optimizer states by parameter name, as a user would convert it)."""
    weights = _union(_gather({n: whole(p) for n, p in module.named_parameters()}))
    out: dict[str, Any] = {"status": "ok", "steps": recorder.steps, "validations": recorder.validations,
                           "weights": weights, "warnings": sorted({w for w in warned if "egaScale" in w or "megascale" in w})}  # fmt: skip
    for callback in callbacks:
        if isinstance(callback, EMA):
            out["ema"] = _union(_gather(callback.whole()))
    end = work / "end.ckpt"
    trainer.save_checkpoint(end)
    if _rank() == 0:
        out["checkpoint"] = _read_checkpoint(end, trainer, module)
    return out


def _read_checkpoint(path: Path, trainer: Trainer, module: ConformanceModule) -> dict[str, Any]:
    """{"model": {name: tensor}, "optimizers": [{"state": {name: {key: value}}, "lrs": {name: lr}}]}."""
    if path.is_dir():  # MegaScaleStrategy: a DCP directory, converted as a user would
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(path, path.with_suffix(".pt"))
        saved = torch.load(path.with_suffix(".pt"), weights_only=True)
        optimizers = []
        while f"optimizer_{len(optimizers)}" in saved:
            flat = saved[f"optimizer_{len(optimizers)}"]  # DCP's flattened keys: state.<name>.<key>
            state: dict[str, dict[str, Any]] = {}
            lrs = {}
            for key, value in flat.items():
                kind, _, rest = key.partition(".")
                name, _, item = rest.rpartition(".")
                if kind == "state":
                    state.setdefault(name, {})[item] = (
                        value.float() if isinstance(value, torch.Tensor) else value
                    )
                elif kind == "param_groups" and item == "lr":
                    lrs[name] = float(value)
            optimizers.append({"state": state, "lrs": lrs})
        return {"model": {k: v.float() for k, v in saved["state_dict"].items()}, "optimizers": optimizers}
    saved = torch.load(path, weights_only=True)
    names = {id(p): n for n, p in module.named_parameters()}
    optimizers = []
    for optimizer, saved_state in zip(trainer.optimizers, saved["optimizer_states"]):
        groups = saved_state["param_groups"]
        if all("param_names" in g for g in groups):  # MegaScaleStrategy's one file: every stage's parameters
            order = [n for g in groups for n in g["param_names"]]
            lrs = {n: float(g["lr"]) for g in groups for n in g["param_names"]}
        else:  # one process: numbered in its optimizer's order
            order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
            lrs = {names[id(p)]: float(g["lr"]) for g in optimizer.param_groups for p in g["params"]}
        state = {order[i]: {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                 for i, s in saved_state["state"].items()}  # fmt: skip
        optimizers.append({"state": state, "lrs": lrs})
    return {"model": {k: v.float() for k, v in saved["state_dict"].items()}, "optimizers": optimizers}


def _in_step() -> bool:
    """Whether every rank is still answering (after a job that raised on some ranks only, they are not)."""
    if not dist.is_initialized():
        return True
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=30))
        return True
    except RuntimeError:
        return False


def main(spec_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jobs = json.loads(Path(spec_path).read_text())["jobs"]
    if "RANK" in os.environ and not dist.is_initialized():  # torchrun: one group for every job
        dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    broken = None
    for job in jobs:
        cell = job["cell"]
        Path(job["work"]).mkdir(parents=True, exist_ok=True)
        start, cpu = time.perf_counter(), time.process_time()
        if broken is not None:
            result: dict[str, Any] = {"status": "not run", "error": f"the ranks fell out of step in {broken}"}
        else:
            try:
                result = run_job(job)
            except Exception as e:  # a refusal (checked by the test) or a defect
                (out / f"{cell}.rank{_rank()}.error").write_text(traceback.format_exc())
                result = {"status": "error", "error_type": type(e).__name__, "error": str(e)}
            if not _in_step():
                broken = cell
        if _rank() == 0:
            result["seconds"], result["cpu_seconds"] = time.perf_counter() - start, time.process_time() - cpu
            torch.save(result, out / f"{cell}.pt")
            print(f"{cell}: {result['status']} in {result['seconds']:.1f} s ({result['cpu_seconds']:.1f} s CPU)",
                  flush=True)  # fmt: skip
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized() and broken is None:
        dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:3])
