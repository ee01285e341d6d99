"""Small helpers for parameters that may be DTensors (tensor parallel, FSDP2, both) or plain tensors.

Kept import-light: ``torch.distributed.tensor`` costs ~0.6 s to import, and a DTensor can only exist once it
has been imported, so the checks look it up in ``sys.modules`` instead of importing it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, overload

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["ShardSpec", "is_dtensor", "local", "mark_split", "shard_spec"]

ShardSpec = tuple["ProcessGroup", ...]
"""The process groups a tensor is split over (one per mesh dimension with a non-Replicate placement, and the
data-parallel group for a ZeRO-1 piece): sums over its elements are summed over each of them in turn."""

_SPLIT_ATTR = "_megascale_split_over"


def is_dtensor(t: Any) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


@overload
def local(t: torch.Tensor) -> torch.Tensor: ...
@overload
def local(t: None) -> None: ...
def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """The local shard of a DTensor (differentiable; under no_grad it is the DTensor's own storage, so
    in-place updates reach it); plain tensors pass through."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[union-attr]


def mark_split(t: torch.Tensor, groups: ShardSpec) -> torch.Tensor:
    """Record that the plain tensor ``t`` is one piece of a whole split over ``groups`` (ZeRO-1 steps 1-D
    pieces of parameters, whose LAMB trust-ratio norms are those of the whole); returns ``t``."""
    setattr(t, _SPLIT_ATTR, tuple(groups))
    return t


def shard_spec(t: torch.Tensor) -> ShardSpec | None:
    """The process groups ``t`` is split over; None for a whole tensor (plain, or replicated).

    A DTensor is split over the groups of its mesh dimensions whose placement is not Replicate; a plain
    tensor over what ``mark_split`` recorded, else nothing.

    Every placement other than Replicate splits the tensor: not only Shard but also the _StridedShard that
    FSDP2 puts on the data-parallel dimension of FSDP2 × TP parameters (which is no Shard in torch 2.13).
    Partial (unreduced) tensors are refused: their local values are not pieces of the whole.
    """
    if not is_dtensor(t):
        return getattr(t, _SPLIT_ATTR, None)
    placements = t.placements  # type: ignore[attr-defined]
    if any(p.is_partial() for p in placements):
        raise ValueError(f"a tensor with Partial placements {placements} has no well-defined shards")
    mesh = t.device_mesh  # type: ignore[attr-defined]
    groups = tuple(mesh.get_group(i) for i, p in enumerate(placements) if not p.is_replicate())
    return groups or None
