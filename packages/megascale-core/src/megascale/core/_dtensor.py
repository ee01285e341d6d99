"""Small helpers for parameters that may be DTensors (tensor parallel, FSDP2, both) or plain tensors.

Kept import-light: ``torch.distributed.tensor`` costs ~0.6 s to import, and a DTensor can only exist once it
has been imported, so the checks look it up in ``sys.modules`` instead of importing it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, overload

import torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ShardSpec", "is_dtensor", "local", "shard_spec"]

ShardSpec = tuple["DeviceMesh", tuple[int, ...]]
"""(mesh, the mesh dimensions a tensor is split over)."""


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


def shard_spec(t: torch.Tensor) -> ShardSpec | None:
    """The mesh and mesh dimensions ``t`` is split over; None for a whole tensor (plain, or replicated).

    Every placement other than Replicate splits the tensor: not only Shard but also the _StridedShard that
    FSDP2 puts on the data-parallel dimension of FSDP2 × TP parameters (which is no Shard in torch 2.13).
    Partial (unreduced) tensors are refused: their local values are not pieces of the whole.
    """
    if not is_dtensor(t):
        return None
    placements = t.placements  # type: ignore[attr-defined]
    if any(p.is_partial() for p in placements):
        raise ValueError(f"a tensor with Partial placements {placements} has no well-defined shards")
    dims = tuple(i for i, p in enumerate(placements) if not p.is_replicate())
    return (t.device_mesh, dims) if dims else None  # type: ignore[attr-defined]
