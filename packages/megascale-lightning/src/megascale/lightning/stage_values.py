"""Logged values under pipeline parallelism: the same on every stage, or refused by name.

With pp > 1 a value derived from the batch (the loss, an accuracy) reaches every stage of a replica alike: the
schedule hands the last stage's loss to all of them. A value computed from ``self.parameters()`` (an L2 penalty,
a weight norm) covers this stage's layers only, and rank 0 (the first stage) would log its own share as the
whole model's, silently. ``self.log(..., sync_dist=True)`` therefore compares what the stages hold before
reducing it over the data-parallel ranks, and refuses a value they disagree on.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

__all__ = ["check_same_on_every_stage"]


def check_same_on_every_stage(value: Tensor, pp_group: ProcessGroup, hook: str | None = None) -> None:
    """Raise ValueError, on every rank of ``pp_group``, if ``value`` differs between its pipeline stages.
    Every stage must call it for the same value (as for any ``sync_dist`` reduction). ``hook``: the
    LightningModule hook that logged it, for the message."""
    local = value.detach().reshape(-1).to(torch.float64)
    stages = local.new_empty(dist.get_world_size(pp_group) * local.numel())
    dist.all_gather_into_tensor(stages, local, group=pp_group)
    stages = stages.view(-1, local.numel())
    if all(torch.allclose(stage, stages[0], rtol=1e-6, atol=0.0, equal_nan=True) for stage in stages[1:]):
        return
    shown = ", ".join(
        f"{stage.tolist()[0] if stage.numel() == 1 else stage.tolist()} on stage {i}"
        for i, stage in enumerate(stages)
    )
    where = f" in {hook}" if hook else ""
    raise ValueError(
        f"a value logged with sync_dist=True{where} differs between the pipeline stages ({shown}): with "
        f"pp={stages.shape[0]} each stage holds its own layers, so a value computed from self.parameters() (an L2 "
        "penalty, a weight norm) covers that stage only, and rank 0 would log its first stage's share as the "
        "whole model's. Sum the shares over the stages before logging (torch.distributed.all_reduce over "
        "self.device_mesh['pp'].get_group()), or use pp=1"
    )
