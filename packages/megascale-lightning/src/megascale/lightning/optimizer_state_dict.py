"""An optimizer's ``torch.distributed.checkpoint`` state dict holding the states this rank holds, none made up.

``get_optimizer_state_dict`` steps an optimizer that holds no state once, at learning rate 0, so that every
parameter has a state to write or load into. Where a rank legitimately holds none (ZeRO-1 by parameters: it
owns none of that optimizer's parameters), those zero buffers would be written beside the owner's real states,
and DCP keeps one rank's copy of a key: the made-up one could win (gen-445). Loaded, they would sit on a rank
that never steps them, written again at the next save.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _get_fqns,
    get_optimizer_state_dict,
)
from torch.optim import Optimizer

from megascale.core.parallel.zero.optimizer_state import optimizer_params

__all__ = ["Keep", "keep_states", "names_by_param", "names_of", "optimizer_state_dict", "unwritable_state"]


def unwritable_state(optimizer: Optimizer, error: NotImplementedError) -> ValueError:
    """What torch.distributed.checkpoint's refusal of ``optimizer``'s state means, naming the optimizer."""
    return ValueError(
        f"{type(optimizer).__name__}'s state cannot be written to a megascale checkpoint "
        f"(torch.distributed.checkpoint: {error}); its values are not one tensor per parameter (LBFGS "
        "keeps lists of past steps). Train with an optimizer whose state is per parameter (AdamW, SGD, "
        "LAMB), or without checkpoints"
    )


Keep = Literal["held", "prepared", "every"]


def optimizer_state_dict(
    model: nn.Module,
    optimizer: Optimizer,
    options: StateDictOptions,
    *,
    prepare: Callable[[Optimizer], None] = lambda _: None,
    keep: Keep = "held",
    prepared_names: set[str] | None = None,
) -> dict[str, Any]:
    """``get_optimizer_state_dict(model, optimizer, options=options)`` after ``prepare(optimizer)`` (ZeRO-1:
    states made whole, or created for the parameters a rank owns), holding the states of the parameters
    that ``keep`` says: "held" those the optimizer held before (what a run has: to save), "prepared" those
    it holds after ``prepare`` (a ZeRO-1 rank's own: a template to load them into), "every" every
    parameter's (DCP's template for a rank that loads all). The optimizer is left holding the states it
    held before. Nested or flattened (``options``) alike. ``prepared_names``: filled with the names of the
    parameters holding a state after ``prepare``."""
    held = {id(p) for p in optimizer_params(optimizer) if optimizer.state.get(p)}
    prepare(optimizer)
    prepared = {id(p) for p in optimizer_params(optimizer) if optimizer.state.get(p)}
    try:
        state = dict(get_optimizer_state_dict(model, optimizer, options=options))
    except NotImplementedError as error:  # torch's message speaks of flattening, not of the optimizer
        raise unwritable_state(optimizer, error) from error
    finally:
        for p in optimizer_params(optimizer):
            if id(p) not in held:
                optimizer.state.pop(p, None)
    if prepared_names is not None:
        prepared_names.update(names_of(model, prepared))
    kept = {"held": held, "prepared": prepared}.get(keep)
    if kept is None or len(kept) == len(optimizer_params(optimizer)):
        return state
    names = names_of(model, kept)
    nested = state.get("state")  # nested: {"state": {name: {...}}, "param_groups": [...]}
    if isinstance(nested, dict):
        return {**state, "state": {n: v for n, v in nested.items() if n in names}}
    # flattened: "state.<name>.<key>", "param_groups.<name>.<key>"
    return {
        key: value
        for key, value in state.items()
        if not key.startswith("state.") or key.removeprefix("state.").rpartition(".")[0] in names
    }


def names_by_param(model: nn.Module) -> dict[int, set[str]]:
    """id(parameter) -> its state-dict names (every name of a shared parameter)."""
    names: dict[int, set[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), set()).update(_get_fqns(model, name))
    return names


def names_of(model: nn.Module, params: set[int]) -> set[str]:
    """The state-dict names of the parameters of ``model`` whose ids are in ``params``."""
    return {name for i, names in names_by_param(model).items() if i in params for name in names}


def keep_states(model: nn.Module, optimizer: Optimizer, names: set[str]) -> None:
    """Forget ``optimizer``'s states of the parameters none of whose names is in ``names``."""
    by_param = names_by_param(model)
    for p in optimizer_params(optimizer):
        if not by_param.get(id(p), set()) & names:
            optimizer.state.pop(p, None)
