"""Gradient norms for logging, whole under every layout: ``lightning.pytorch.utilities.grad_norm``'s output.

Lightning's ``grad_norm(module, norm_type)`` reads each ``p.grad`` as one process holds it. Under
MegaScaleStrategy a gradient may be a tensor-parallel or ZeRO-2/3 shard (a DTensor: Lightning's version then
fails inside ``torch.tensor``), or belong to a layer on another pipeline stage (Lightning's version then
silently logs this stage's norms and a total of this stage only). This one returns the same keys with the
norms of the whole gradients of the whole model on every rank, so ``self.log_dict(grad_norm(self, 2))`` in
``on_before_optimizer_step`` logs what one process would. Every rank must call it (it communicates).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import Tensor

from megascale.core._dtensor import is_dtensor

__all__ = ["grad_norm"]


def grad_norm(
    module: LightningModule, norm_type: float | int | str, group_separator: str = "/"
) -> dict[str, Tensor]:
    """Per-parameter gradient norms and their total, as ``lightning.pytorch.utilities.grad_norm`` gives them on
    one process (keys ``grad_{norm_type}_norm{sep}{name}`` and ``grad_{norm_type}_norm_total``), for the whole
    gradients of the whole model under any MegaScaleStrategy layout.

    Args:
        module: the LightningModule (its parameters, its strategy's pipeline group).
        norm_type: the p of the p-norm; ``"inf"`` for the max norm.
        group_separator: between the prefix and the parameter name (TensorBoard groups on "/").
    """
    p = float(norm_type)
    norms: dict[str, float] = {}
    for name, param in module.named_parameters():
        if param.grad is None:
            continue
        grad = param.grad.detach()
        # a DTensor's norm over its mesh (a collective): every rank holding a shard of it calls this, in order
        value = grad.float().norm(p)
        norms[name] = float(value.full_tensor() if is_dtensor(value) else value)  # type: ignore[attr-defined]
    norms = _union_over_stages(module, norms)
    out = {f"grad_{p}_norm{group_separator}{name}": torch.tensor(value) for name, value in norms.items()}
    if norms:
        out[f"grad_{p}_norm_total"] = torch.tensor(list(norms.values())).norm(p)
    return out


def _union_over_stages(module: LightningModule, norms: dict[str, float]) -> dict[str, float]:
    """Pipeline stages hold different layers: every rank gets every stage's norms (by parameter name)."""
    trainer = module._trainer
    mesh = getattr(trainer.strategy, "device_mesh", None) if trainer is not None else None
    if mesh is None or not dist.is_initialized() or mesh["pp"].size() == 1:
        return norms
    group = mesh["pp"].get_group()
    parts: list[dict[str, float] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, norms, group=group)
    union: dict[str, float] = {}
    for part in parts:
        assert part is not None
        union.update(part)
    return union
