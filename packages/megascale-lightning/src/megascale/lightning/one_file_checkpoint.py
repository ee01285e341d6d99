"""One-file checkpoints: ``MegaScaleStrategy(save_distributed_checkpoint=False)`` writes Lightning's own form.

The file is what Lightning's ``DDPStrategy`` writes, read by everything that reads those (``load_from_checkpoint``,
``torch.load``, ``Trainer.fit(ckpt_path=...)`` under DDP or any megascale layout):
    state_dict          every model tensor whole, keyed as the LightningModule's ``state_dict()``: the union of
                        the pipeline stages' tensors, DTensors (tp, ep, ZeRO-2/3) gathered;
    optimizer_states    one ``Optimizer.state_dict()`` per optimizer in torch's form (parameters numbered in
                        one process's order: each group's parameters stage after stage), whole states, and each
                        group's ``param_names`` (torch's optional key), by which a layout loads its own;
    the rest            Lightning's entries (loops, callbacks, schedulers, hyper-parameters) and megascale's.
It is gathered onto global rank 0 and written there by the strategy's ``CheckpointIO`` (so any URL fsspec
reaches); loading reads it on every rank and keeps each rank's part. Every rank holds whole values for a while:
a form for models that fit one process's memory; larger ones save directories (``checkpoint_io``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer
from torch.utils._pytree import tree_map

from megascale.lightning.optimizer_state_dict import Keep, keep_states, optimizer_state_dict

__all__ = ["gathered_checkpoint", "load_into"]

MODEL_KEY = "state_dict"
OPTIMIZERS_KEY = "optimizer_states"


def _on_cpu(state: Any) -> Any:
    return tree_map(lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v, state)


def gathered_checkpoint(
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    *,
    sends_model: bool,
    sends_optimizers: bool,
    before_optimizer_state: Callable[[Optimizer], None],
) -> dict[str, Any] | None:
    """``{"state_dict": ..., "optimizer_states": [...]}`` whole, on global rank 0 (None elsewhere); every rank
    calls it. ``sends_model``/``sends_optimizers``: this rank holds values no rank before it holds (the first
    rank of its pipeline stage; for optimizer states also each ZeRO-1 owner)."""
    weights = _on_cpu(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))
    states = []
    options = StateDictOptions(full_state_dict=True)
    for optimizer in optimizers:
        states.append(
            _on_cpu(optimizer_state_dict(model, optimizer, options, prepare=before_optimizer_state))
        )
    piece = (weights if sends_model else {}, states if sends_optimizers else None)
    pieces: list[Any] = [piece]
    if dist.is_available() and dist.is_initialized():
        pieces = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
        dist.gather_object(piece, pieces if dist.get_rank() == 0 else None, dst=0)
        if dist.get_rank() != 0:
            return None
    merged: dict[str, Any] = {}
    for part, _ in pieces:
        for key, value in part.items():
            merged.setdefault(key, value)
    optimizer_states = [
        _torch_form([part[i] for _, part in pieces if part is not None]) for i in range(len(optimizers))
    ]
    return {MODEL_KEY: merged, OPTIMIZERS_KEY: optimizer_states}


def _one_process_groups(groups_by_rank: list[list[list[str]]]) -> list[list[str]]:
    """Each group's parameter names as one process holds them: the ranks' (pipeline stages', ZeRO-1 owners')
    lists of that group, in rank order, each name once."""
    names: list[list[str]] = []
    seen: set[str] = set()
    for groups in groups_by_rank:
        for g, group in enumerate(groups):
            if g == len(names):
                names.append([])
            names[g] += [name for name in group if name not in seen]
            seen.update(group)
    return names


def _torch_form(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Name-keyed optimizer state dicts of ranks (pipeline stages, ZeRO-1 owners), in rank order, as one
    ``Optimizer.state_dict()`` of one process: parameters numbered group by group, stage after stage."""
    names = _one_process_groups([[group["params"] for group in part["param_groups"]] for part in parts])
    settings: dict[int, dict[str, Any]] = {}
    state: dict[str, Any] = {}
    for part in parts:
        for g, group in enumerate(part["param_groups"]):
            settings.setdefault(g, {k: v for k, v in group.items() if k not in ("params", "param_names")})
        for name, value in part["state"].items():
            state.setdefault(name, value)
    number = {name: i for i, name in enumerate(name for group in names for name in group)}
    return {
        "state": {number[name]: value for name, value in state.items()},
        "param_groups": [
            {**settings[g], "params": [number[n] for n in group], "param_names": list(group)}
            for g, group in enumerate(names)
        ],
    }


def _every_rank(value: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _one_process_names(template: dict[str, Any]) -> list[str]:
    """The parameter names in one process's order (groups in turn, each stage after stage), from every rank's
    name-keyed ``template``: what numbers an ``Optimizer.state_dict()`` written without ``param_names``."""
    groups = _one_process_groups(_every_rank([group["params"] for group in template["param_groups"]]))
    return [name for group in groups for name in group]


def _by_name(
    saved: dict[str, Any], template: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(state, group settings) of a saved ``Optimizer.state_dict()`` keyed by parameter name."""
    order = None
    state: dict[str, Any] = {}
    settings: dict[str, dict[str, Any]] = {}
    for group in saved["param_groups"]:
        if "param_names" in group:
            group_names = list(group["param_names"])
        else:  # written by one process (DDPStrategy): numbered in its order
            order = order if order is not None else _one_process_names(template)
            group_names = [order[i] if i < len(order) else f"<parameter {i}>" for i in group["params"]]
        values = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        for number, name in zip(group["params"], group_names):
            settings[name] = values
            if number in saved["state"]:
                state[name] = saved["state"][number]
    return state, settings


def load_into(
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    checkpoint: dict[str, Any],
    *,
    strict: bool,
    before_optimizer_state: Callable[[Optimizer], None],
    holds_all_states: Callable[[Optimizer], bool],
) -> None:
    """Set this rank's part of the model and optimizer states from a one-file ``checkpoint`` (read on every
    rank); pops its model and optimizer entries. Every rank calls it; what cannot load is refused on all."""
    weights = checkpoint.pop(MODEL_KEY)
    saved_states = checkpoint.pop(OPTIMIZERS_KEY, [])
    mine = get_model_state_dict(model)
    problem = None
    missing = sorted(k for k in mine if k not in weights)
    unexpected = sorted(k for k in weights if k not in set().union(*_every_rank(set(mine))))
    if strict and (missing or unexpected):
        problem = (
            f"its model differs from this one (missing {missing[:5]}, unexpected {unexpected[:5]}): build the "
            "model of that run, or set the LightningModule's strict_loading = False"
        )
    if len(saved_states) != len(optimizers):
        problem = problem or (
            f"it holds {len(saved_states)} optimizer states and this run has {len(optimizers)} optimizers: "
            "resume with the configure_optimizers of that run"
        )
    wholes = []
    for optimizer, saved in zip(optimizers, saved_states):
        # a ZeRO-1 rank loads the states it owns; any other, a state for each parameter the file has one for
        keep: Keep = "every" if holds_all_states(optimizer) else "prepared"
        template = optimizer_state_dict(
            model, optimizer, StateDictOptions(), prepare=before_optimizer_state, keep=keep
        )
        state, settings = _by_name(saved, template)
        # a parameter without state in the file had none in that run (never stepped): it gets none here either
        absent = [n for g in template["param_groups"] for n in g["params"] if n not in settings]
        if absent:
            problem = problem or (
                f"it has no {type(optimizer).__name__} state for {absent[:3]}: resume with the optimizer "
                "(class, settings, parameters) of that run"
            )
            continue
        groups = [
            {**settings[group["params"][0]], "params": group["params"]} if group["params"] else group
            for group in template["param_groups"]
        ]
        wholes.append(
            {"state": {n: state[n] for n in template["state"] if n in state}, "param_groups": groups}
        )
    problem = next((p for p in _every_rank(problem) if p is not None), None)
    if problem is not None:
        raise ValueError(f"cannot resume this checkpoint: {problem}")
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, {k: weights[k] for k in mine if k in weights}, options=options)
    for optimizer, whole in zip(optimizers, wholes):
        options = StateDictOptions(full_state_dict=True, strict=holds_all_states(optimizer))
        set_optimizer_state_dict(model, optimizer, cast(Any, whole), options=options)
        # torch makes up a state for every parameter it is given none for: not one a run would hold
        keep_states(model, optimizer, set(whole["state"]))
