"""ZeRO stages 2 and 3 on FSDP2 (``torch.distributed.fsdp.fully_shard``).

Why FSDP2 here: it already is ZeRO-2/3 for DTensor parameters — it shards each parameter on the
data-parallel mesh dimension (composing with our tensor-parallel DTensors into 2-D shards), reduce-scatters
gradients per unit as backward reaches it, keeps fp32 sharded master weights with bf16 compute copies, and
its shards are DTensors, so ``torch.distributed.checkpoint`` reshards them across layouts. Re-implementing
that would add risk and no capability. Stages 0/1 are megascale's own (``zero.py``), where replicated
parameters make a DDP-style bucketed all-reduce cheaper than FSDP2's per-parameter machinery.

- stage 2: ``reshard_after_forward=False``. Parameters stay gathered from forward to backward; gradients are
  reduce-scattered unit by unit during backward; optimizer state and gradients are sharded. PyTorch
  documents this mode (SHARD_GRAD_OP) as ZeRO-2; parameters are also sharded between steps, which only
  saves memory (they are gathered again, prefetched, in the next forward).
- stage 3: ``reshard_after_forward=True``. Parameters are gathered per unit just in time in forward and again
  in backward. With ``prefetch``, unit i's forward issues unit i+1's all-gather (and backward the previous
  unit's), and ``prefetch_first_unit`` issues the first unit's gather before a forward starts.

A unit ("bucket") is a group of consecutive blocks of at most ``bucket_size_mb`` of parameters; the
embedding and the head are units of their own. ``overlap_grad_reduce=False`` makes the whole model one unit:
one reduce-scatter after the whole backward, nothing overlapped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from megascale.core.model.gpt import GPT
from megascale.core.parallel.pipeline import StageModule

__all__ = ["FSDPUnits", "apply_fsdp"]


class FSDPUnits:
    """The FSDP2 units of a model in forward order, and the prefetch wiring between them."""

    def __init__(self, root: FSDPModule, units: list[FSDPModule]) -> None:
        self.root = root
        self.units = units

    def prefetch_first_unit(self) -> None:
        """Issue the first unit's all-gather now, so the next forward finds it in flight or done."""
        if self.units:
            self.units[0].unshard(async_op=True)

    def set_requires_gradient_sync(self, sync: bool) -> None:
        self.root.set_requires_gradient_sync(sync)


def _bytes(modules: list[nn.Module]) -> int:
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


def _group_blocks(blocks: list[nn.Module], bucket_bytes: float) -> list[list[nn.Module]]:
    groups: list[list[nn.Module]] = []
    for block in blocks:
        if groups and _bytes(groups[-1] + [block]) <= bucket_bytes:
            groups[-1].append(block)
        else:
            groups.append([block])
    return groups


def apply_fsdp(
    model: GPT | StageModule,
    dp_mesh: DeviceMesh,
    *,
    stage: int,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    bucket_size_mb: float = 0.0,
    overlap_grad_reduce: bool = True,
    prefetch: bool = True,
) -> FSDPUnits:
    """Shard ``model`` (already tensor-parallel, if at all) over ``dp_mesh`` as ZeRO ``stage`` 2 or 3.

    ``model`` is a GPT, or one pipeline stage of it (a ``StageModule``, which then becomes the FSDP root: the
    pipeline schedule calls stages, not the GPT).

    Args:
        param_dtype: compute dtype of the gathered parameters (bf16 for mixed precision); the sharded
            master parameters keep their own dtype (fp32).
        reduce_dtype: dtype of the gradient reduce-scatter (fp32: gradients are summed in full precision).
        bucket_size_mb: blocks are grouped into units of at most this many MB (0: one block per unit).
        overlap_grad_reduce: units per bucket, reduced during backward; False: one unit, reduced at the end.
        prefetch: gather unit i+1 while unit i computes (forward and backward).
    """
    if stage not in (2, 3):
        raise ValueError(f"apply_fsdp implements ZeRO stages 2 and 3, not {stage}")
    kwargs: dict[str, Any] = {
        "mesh": dp_mesh,
        "reshard_after_forward": stage == 3,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
    }
    units: list[FSDPModule] = []
    if overlap_grad_reduce:
        groups: list[list[nn.Module]] = [[model.embed]] if model.embed is not None else []
        groups += _group_blocks(list(model.blocks.values()), bucket_size_mb * 2**20)
        groups += [[model.head]] if model.head is not None else []
        for group in groups:
            # a list becomes one unit (one parameter group) whose modules share its state: keep the first
            sharded = fully_shard(group, **kwargs) if len(group) > 1 else [fully_shard(group[0], **kwargs)]
            units.append(sharded[0])
    root = fully_shard(model, **kwargs)
    if not units:
        units = [root]
    if prefetch and len(units) > 1:
        for i, unit in enumerate(units):
            unit.set_modules_to_forward_prefetch(units[i + 1 : i + 2])
            unit.set_modules_to_backward_prefetch(units[i - 1 : i] if i > 0 else [])
    elif len(units) > 1:
        for unit in units:
            unit.set_modules_to_backward_prefetch([])
    return FSDPUnits(root, units)
