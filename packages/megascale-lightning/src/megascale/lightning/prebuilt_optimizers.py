"""Optimizers built before the model was split, pointed at the split parameters.

``configure_optimizers`` may return an optimizer built earlier (in ``__init__`` or ``setup``) over
``self.parameters()``. Splitting the model (tensor parallelism, ZeRO-2/3's FSDP2, experts) replaces those
parameters by new ones (DTensors), so such an optimizer would step tensors the model no longer uses: the
weights never move, and nothing says so. Each parameter of an optimizer that the module no longer holds is
replaced, in the optimizer's groups and state, by the one that now holds its name. Where no parameter holds
that name any more (a pipeline stage holds its own layers only), the optimizer cannot be kept, and the run
stops saying to build it in ``configure_optimizers``.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.optim import Optimizer

__all__ = ["names_of", "point_at_split_parameters"]


Names = dict[int, tuple[str, nn.Parameter]]


def names_of(module: nn.Module) -> Names:
    """Each parameter's name, taken before the split. The parameters are held until the optimizers are set up,
    so no other tensor gets one's ``id`` meanwhile (a weak reference would stop torch from swapping them)."""
    return {id(p): (name, p) for name, p in module.named_parameters(remove_duplicate=False)}


def _name_before(p: Tensor, names_before: Names) -> str | None:
    entry = names_before.get(id(p))
    return entry[0] if entry is not None and entry[1] is p else None


def point_at_split_parameters(
    optimizers: list[Optimizer], module: nn.Module, names_before: Names
) -> list[str]:
    """Replace, in ``optimizers``, every parameter of ``module`` from before the split (``names_before``) by the
    one holding its name now; returns the names replaced. A parameter the module never held is left as it is;
    one whose name the module no longer has is refused (ValueError)."""
    now = dict(module.named_parameters(remove_duplicate=False))
    current = {id(p) for p in now.values()}

    def old_name(p: Tensor) -> str | None:
        return None if id(p) in current else _name_before(p, names_before)

    stale = [
        name
        for optimizer in optimizers
        for group in optimizer.param_groups
        for p in group["params"]
        if (name := old_name(p)) is not None
    ]
    lost = [name for name in stale if name not in now]
    if lost:
        raise ValueError(
            f"configure_optimizers returned an optimizer built before the model was split, over parameters this "
            f"rank no longer holds ({', '.join(lost[:3])}{', ...' if len(lost) > 3 else ''}: a pipeline stage "
            "holds its own layers only). Build the optimizer inside configure_optimizers, over self.parameters()"
        )
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [p if (name := old_name(p)) is None else now[name] for p in group["params"]]
        for p in list(optimizer.state):
            if (name := old_name(p)) is not None:
                optimizer.state[now[name]] = optimizer.state.pop(p)
    return stale
