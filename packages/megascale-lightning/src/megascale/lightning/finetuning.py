"""Lightning's ``BaseFinetuning`` under every layout: which parameters are "already in the optimizer".

``BaseFinetuning.unfreeze_and_add_param_group`` leaves out the parameters it is given that its
``filter_on_optimizer`` finds in the optimizer, by comparing each with every optimizer parameter with
``torch.equal``: by value, so a parameter merely *equal* to one in the optimizer (a zero-initialised bias
never trained, say) is left out too, with Lightning's warning. Under a split model that comparison raises (a
tensor-parallel DTensor against a plain tensor, or DTensors of two meshes) or deadlocks (DTensor's ``equal``
all-reduces over the whole world, while pipeline stages compare different parameters).

`adapt` gives each ``BaseFinetuning`` callback of a fit an ``unfreeze_and_add_param_group`` that runs
Lightning's own, with a filter deciding what one process holding the whole model decides:

- a parameter that is itself in the optimizer is left out (``torch.equal(p, p)``);
- any other is left out when its whole value equals that of an optimizer parameter anywhere in the model
  (same shape, values compared across dtypes with -0.0 == 0.0, NaN equal to nothing: ``torch.equal``'s
  rules). Whole values are compared by a digest, gathered (``full_tensor`` over the parameter's own mesh)
  only for shapes found on both sides, and the optimizer's digests are exchanged over the pipeline stages,
  since one process's optimizer holds every stage's parameters.

Every rank of a stage holds the same parameters in the same order, so the gathers line up; stages exchange
only the fixed two messages over the pipeline group.
"""

from __future__ import annotations

import functools
import hashlib
import secrets
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer

from megascale.core._dtensor import is_dtensor

__all__ = ["adapt", "filter_on_optimizer"]

Shape = tuple[int, ...]
_ORIGINAL = "_megascale_unfreeze_and_add_param_group"


def adapt(callback: BaseFinetuning, pp_group: dist.ProcessGroup | None) -> None:
    """Give ``callback`` (this fit's) an ``unfreeze_and_add_param_group`` and ``filter_on_optimizer`` that
    work on split models; ``pp_group``: the pipeline stages' group (None without pp)."""
    keep = functools.partial(filter_on_optimizer, pp_group=pp_group)
    # Lightning's, or the callback's own override; kept from an earlier fit (whose groups are gone), not wrapped twice
    theirs = callback.__dict__.get(_ORIGINAL) or callback.unfreeze_and_add_param_group
    setattr(callback, _ORIGINAL, theirs)

    def unfreeze_and_add_param_group(*args: Any, **kwargs: Any) -> None:
        # as it was, with the class-qualified BaseFinetuning.filter_on_optimizer it calls ours during the call
        saved = BaseFinetuning.__dict__["filter_on_optimizer"]
        BaseFinetuning.filter_on_optimizer = staticmethod(keep)  # type: ignore[method-assign,assignment]
        try:
            theirs(*args, **kwargs)
        finally:
            BaseFinetuning.filter_on_optimizer = saved  # type: ignore[method-assign]

    callback.unfreeze_and_add_param_group = unfreeze_and_add_param_group  # type: ignore[method-assign]
    callback.filter_on_optimizer = keep  # type: ignore[method-assign]


def filter_on_optimizer(
    optimizer: Optimizer, params: Iterable[torch.Tensor], pp_group: dist.ProcessGroup | None = None
) -> list[torch.Tensor]:
    """``params`` but those one process would find in ``optimizer`` (``BaseFinetuning.filter_on_optimizer``
    over the whole model); a collective over each parameter's mesh and ``pp_group``."""
    params = list(params)
    held = [p for group in optimizer.param_groups for p in group["params"]]
    ids = {id(p) for p in held}
    others = [p for p in params if id(p) not in ids]
    stages = _exchange(({_shape(p) for p in others}, {_shape(p) for p in held}), pp_group)
    shapes: set[Shape] = set()
    for _, theirs in stages:
        shapes |= theirs
    shapes &= set().union(*(ours for ours, _ in stages))  # shapes given here and held in an optimizer
    digests: set[str] = set().union(*_exchange({_digest(p) for p in held if _shape(p) in shapes}, pp_group))
    kept: list[torch.Tensor] = []
    removed: list[torch.Tensor] = []
    for p in params:
        same = id(p) in ids or (_shape(p) in shapes and _digest(p) in digests)
        (removed if same else kept).append(p)
    if removed:  # Lightning's warning, word for word
        rank_zero_warn(
            "The provided params to be frozen already exist within another group of this optimizer."
            " Those parameters will be skipped.\n"
            "HINT: Did you init your optimizer in `configure_optimizer` as such:\n"
            f" {type(optimizer)}(filter(lambda p: p.requires_grad, self.parameters()), ...) ",
        )
    return kept


def _shape(tensor: torch.Tensor) -> Shape:
    return tuple(tensor.shape)  # a DTensor's is the whole tensor's


def _digest(tensor: torch.Tensor) -> str:
    """Of the whole value as torch.equal sees it: in float64 (exact for every float dtype), -0.0 as 0.0."""
    whole = tensor.full_tensor() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]
    values = whole.detach().to(torch.float64) + 0.0
    if values.isnan().any():
        return f"nan {secrets.token_hex(8)}"  # torch.equal finds NaN equal to nothing, itself included
    data = values.cpu().contiguous().numpy().tobytes()
    return hashlib.blake2b(data, digest_size=20).hexdigest() + f" {_shape(tensor)}"


def _exchange(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    if group is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
