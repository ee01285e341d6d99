"""Precision plugins for MegaScaleStrategy: Lightning's own, with two changes.

1. Gradient clipping by norm uses the true global norm (``megascale.core.parallel.grad_clip``): gradients of
   tensor-parallel shards are counted once over the whole tensor, replicated parameters once, FSDP shards
   once. torch's ``clip_grad_norm_`` cannot mix DTensors of different meshes and plain tensors.
2. A hook between clipping and the optimizer's update: ZeRO-1 drops the gradients of parameters this rank
   does not own there, after they took part in the global norm and before the optimizer sees them.

Supported precisions: "32-true" and "bf16-mixed" (autocast to bf16 over fp32 parameters: fp32 master
weights and fp32 gradients, so the gradient reduction is fp32; under ZeRO-2/3 FSDP2 also gathers the
parameters in bf16 and reduce-scatters the gradients in fp32). "16-mixed" needs a loss scaler and is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

from lightning.fabric.utilities.types import Steppable
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch.optim import Optimizer
from typing_extensions import override

from megascale.core._dtensor import is_dtensor, local
from megascale.core.parallel.grad_clip import clip_grad_norm_
from megascale.lightning.dtensor_errors import first_line, is_collective_on_dtensor, named
from megascale.lightning.whole_gradients import whole_gradients

__all__ = ["MegaScaleMixedPrecision", "MegaScalePrecision", "to_megascale_precision"]

SUPPORTED = ("32-true", "bf16-mixed")


class _GlobalNormClipping:
    before_optimizer_step: Callable[[Optimizer], None] | None = None
    grad_norm_group: Any = (
        None  # ranks holding different gradients (pipeline stages, ZeRO-1 pieces), or a callable
    )
    # user code reads gradients there, and some are shards: gathered whole for it (whole_gradients.py)
    gather_for_readers: bool = False

    def _set_hooks(
        self, before_optimizer_step: Callable[[Optimizer], None] | None, grad_norm_group: Any
    ) -> None:
        self.before_optimizer_step, self.grad_norm_group = before_optimizer_step, grad_norm_group

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        params = self.main_params(optimizer)  # type: ignore[attr-defined]
        group = self.grad_norm_group() if callable(self.grad_norm_group) else self.grad_norm_group
        clip_grad_norm_(params, clip_val, sum_group=group)

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        # elementwise, so each rank clamps what it holds (tensor-parallel and ZeRO shards, ZeRO-1 pieces);
        # torch's clip_grad_value_ cannot take DTensors of several meshes and plain tensors in one call
        for p in self.main_params(optimizer):  # type: ignore[attr-defined]
            if p.grad is not None:
                local(p.grad).clamp_(min=-clip_val, max=clip_val)

    def _after_closure(self, model: LightningModule, optimizer: Steppable) -> None:
        # on_before_optimizer_step and configure_gradient_clipping: where user code reads gradients
        reading = whole_gradients(model.parameters()) if self.gather_for_readers else nullcontext()
        try:
            with reading:
                super()._after_closure(model, optimizer)  # type: ignore[misc]
        except (RuntimeError, NotImplementedError) as error:
            if is_collective_on_dtensor(error):
                raise named(error, "on_before_optimizer_step or configure_gradient_clipping") from error
            if isinstance(error, NotImplementedError) or not any(
                is_dtensor(p.grad) for p in model.parameters() if p.grad is not None
            ):
                raise
            first = first_line(error)
            raise RuntimeError(
                "gradients read in on_before_optimizer_step or configure_gradient_clipping are tensor-parallel, "
                "expert-parallel or ZeRO-2/3 shards (DTensors) under MegaScaleStrategy, and the code reading them "
                "failed on that "
                f"({first}). Lightning's grad_norm and torch.nn.utils.clip_grad_norm_/clip_grad_value_ over "
                "DTensors and plain tensors together cannot work: log megascale.lightning.grad_norm(self, 2) "
                "(whole norms under every layout) and clip with Trainer(gradient_clip_val=...) or "
                "self.clip_gradients(...)"
            ) from error

    def _wrap_closure(self, model: LightningModule, optimizer: Steppable, closure: Callable[[], Any]) -> Any:
        result = super()._wrap_closure(model, optimizer, closure)  # type: ignore[misc]  # step, backward, clip
        if self.before_optimizer_step is not None and isinstance(optimizer, Optimizer):
            self.before_optimizer_step(optimizer)
        return result


class MegaScalePrecision(_GlobalNormClipping, Precision):
    """Full precision ("32-true").

    Args:
        before_optimizer_step: called between clipping and the optimizer's update (ZeRO-1 drops there the
            gradients of parameters other ranks step).
        grad_norm_group: the groups over which ranks hold different gradients (pipeline stages, ZeRO-1's
            scattered pieces), None, or a callable returning them at clipping time.
    """

    def __init__(
        self, *, before_optimizer_step: Callable[[Optimizer], None] | None = None, grad_norm_group: Any = None
    ) -> None:
        super().__init__()
        self._set_hooks(before_optimizer_step, grad_norm_group)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        _GlobalNormClipping.clip_grad_by_norm(self, optimizer, clip_val)


class MegaScaleMixedPrecision(_GlobalNormClipping, MixedPrecision):
    """bf16 autocast over fp32 parameters ("bf16-mixed"); the hooks as for ``MegaScalePrecision``."""

    def __init__(
        self,
        precision: str = "bf16-mixed",
        device: str = "cuda",
        *,
        before_optimizer_step: Callable[[Optimizer], None] | None = None,
        grad_norm_group: Any = None,
    ) -> None:
        super().__init__(precision, device)  # type: ignore[arg-type]
        self._set_hooks(before_optimizer_step, grad_norm_group)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        _GlobalNormClipping.clip_grad_by_norm(self, optimizer, clip_val)


def to_megascale_precision(
    plugin: Precision,
    *,
    before_optimizer_step: Callable[[Optimizer], None] | None = None,
    grad_norm_group: Any = None,
) -> MegaScalePrecision | MegaScaleMixedPrecision:
    """The MegaScale version of the plugin Lightning chose from ``Trainer(precision=...)``, with the
    strategy's hooks (see ``MegaScalePrecision``)."""
    hooks = {"before_optimizer_step": before_optimizer_step, "grad_norm_group": grad_norm_group}
    if isinstance(plugin, (MegaScalePrecision, MegaScaleMixedPrecision)):
        plugin._set_hooks(**hooks)
        return plugin
    name = str(getattr(plugin, "precision", ""))
    if type(plugin) is Precision and name == "32-true":
        return MegaScalePrecision(**hooks)
    if isinstance(plugin, MixedPrecision) and name == "bf16-mixed":
        return MegaScaleMixedPrecision("bf16-mixed", device=plugin.device, **hooks)
    raise ValueError(
        f"MegaScaleStrategy supports precision {SUPPORTED}, got {name or type(plugin).__name__!r}. "
        "Use Trainer(precision='bf16-mixed') for mixed precision (fp16 would need a loss scaler)."
    )
