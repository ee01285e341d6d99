"""An optimizer's ``torch.distributed.checkpoint`` state dict holding the states this rank holds, none made up.

``get_optimizer_state_dict`` steps an optimizer that holds no state once, at learning rate 0, so that every
parameter has a state to write or load into. Where a rank legitimately holds none (ZeRO-1 by parameters: it
owns none of that optimizer's parameters), those zero buffers would be written beside the owner's real states,
and DCP keeps one rank's copy of a key: the made-up one could win (gen-445). Loaded, they would sit on a rank
that never steps them, written again at the next save.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _get_fqns,
    get_optimizer_state_dict,
)
from torch.optim import Optimizer

from megascale.core.parallel.zero.optimizer_state import optimizer_params

__all__ = ["optimizer_state_dict", "unwritable_state"]


def unwritable_state(optimizer: Optimizer, error: NotImplementedError) -> ValueError:
    """What torch.distributed.checkpoint's refusal of ``optimizer``'s state means, naming the optimizer."""
    return ValueError(
        f"{type(optimizer).__name__}'s state cannot be written to a megascale checkpoint "
        f"(torch.distributed.checkpoint: {error}); its values are not one tensor per parameter (LBFGS "
        "keeps lists of past steps). Train with an optimizer whose state is per parameter (AdamW, SGD, "
        "LAMB), or without checkpoints"
    )


def optimizer_state_dict(
    model: nn.Module, optimizer: Optimizer, options: StateDictOptions, *, made_up: bool = False
) -> dict[str, Any]:
    """``get_optimizer_state_dict(model, optimizer, options=options)`` with states only for the parameters
    that hold one now (``made_up``: also those DCP creates, a template to load a rank's every state into).
    The optimizer itself is left holding the states it held. Nested or flattened (``options``) alike."""
    held = {id(p) for p in optimizer_params(optimizer) if optimizer.state.get(p)}
    try:
        state = dict(get_optimizer_state_dict(model, optimizer, options=options))
    except NotImplementedError as error:  # torch's message speaks of flattening, not of the optimizer
        raise unwritable_state(optimizer, error) from error
    finally:
        for p in optimizer_params(optimizer):
            if id(p) not in held:
                optimizer.state.pop(p, None)
    if made_up or len(held) == len(optimizer_params(optimizer)):
        return state
    names = {
        fqn
        for name, p in model.named_parameters(remove_duplicate=False)
        if id(p) in held
        for fqn in _get_fqns(model, name)
    }
    if "state" in state:  # nested: {"state": {name: {...}}, "param_groups": [...]}
        return {**state, "state": {n: v for n, v in state["state"].items() if n in names}}
    # flattened: "state.<name>.<key>", "param_groups.<name>.<key>"
    return {
        key: value
        for key, value in state.items()
        if not key.startswith("state.") or key.removeprefix("state.").rpartition(".")[0] in names
    }
