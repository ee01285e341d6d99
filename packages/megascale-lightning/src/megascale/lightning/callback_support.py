"""Lightning features that read or copy the whole model, checked against the layout when a fit starts.

Some of Lightning's own callbacks and modes assume every rank holds every parameter whole, as DDP does. Under
MegaScaleStrategy a parameter may be a tensor-parallel shard or a ZeRO-2/3 shard (a DTensor), or live on
another pipeline stage. Each case here is either made to work or refused, before the first step, with a message
that names the feature, the layout and what to do instead:

- ``StochasticWeightAveraging`` deep-copies the LightningModule in ``setup`` (before the model is split) and
  averages it parameter by parameter against the split model: wrong pairs under pp (a stage holds fewer
  parameters) and mixed DTensor/Tensor arithmetic under tp or ZeRO-2/3. Refused there; exact under dp with
  ZeRO-0/1 (an EMA callback over ``pl_module.parameters()`` works under every layout).
- manual optimization (``automatic_optimization = False``) with pp > 1: a pipeline step runs forward and
  backward for all microbatches inside ``training_step``; a second forward and step by hand cannot be
  scheduled through it. Refused.
- code reading gradients before the step (``on_before_optimizer_step``, ``configure_gradient_clipping``) with
  pp > 1 sees its pipeline stage's gradients only: a norm it takes (Lightning's ``grad_norm``, torch's
  ``clip_grad_norm_``) covers that stage. It cannot be made whole there, so it is warned about, naming the
  readers and the whole-model alternatives (``megascale.lightning.grad_norm``, ``self.clip_gradients``).
- ``BaseFinetuning.unfreeze_and_add_param_group`` drops parameters already in the optimizer by comparing
  values (``torch.equal``) with every optimizer parameter, which raises for a DTensor against a plain tensor,
  and is a collective between sharded ones, which deadlocked across pipeline stages (pp2 × dp2 ZeRO-2):
  refused where the model holds both kinds (tensor parallelism, a model's own ``fully_shard``), DTensors of
  several meshes (expert parallelism's experts beside ZeRO-2/3's dense shards) or sharded ones under pp, with
  the two lines that do the same by hand. Freezing (``freeze_before_training``) and unfreezing by hand work
  under every layout.
"""

from __future__ import annotations

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BaseFinetuning, StochasticWeightAveraging
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from megascale.core._dtensor import is_dtensor
from megascale.core.parallel.mesh import ParallelDims
from megascale.lightning.weight_readers import gradient_readers

__all__ = ["check_trainer_features"]


def _layout(dims: ParallelDims, zero_stage: int, ep: int = 1) -> str:
    cp = f" × cp={dims.cp}" if dims.cp > 1 else ""
    experts = f", experts split over ep={ep} of the dp ranks" if ep > 1 else ""
    return f"dp={dims.dp} × pp={dims.pp}{cp} × tp={dims.tp}, ZeRO stage {zero_stage}{experts}"


def check_trainer_features(
    trainer: Trainer, module: LightningModule, dims: ParallelDims, zero_stage: int, ep: int = 1
) -> None:
    """Refuse (ValueError) what the layout cannot do for this fit's callbacks and module; adapt what it can.
    Called once the model is split, before the first step."""
    layout = _layout(dims, zero_stage, ep)
    sharded = dims.tp > 1 or dims.pp > 1 or ep > 1 or (dims.dp > 1 and zero_stage >= 2)
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, StochasticWeightAveraging) and sharded:
            raise ValueError(
                f"StochasticWeightAveraging cannot run under MegaScaleStrategy at {layout}: it averages a whole "
                "copy of the LightningModule made before the model is split against the split parameters (tensor-, "
                "expert- or ZeRO-2/3 shards, or one pipeline stage's layers). Use tp=1, pp=1, ep=1 and zero_stage 0 "
                "or 1, or keep an average of your own over pl_module.parameters() in a callback (an EMA), which "
                "every layout runs"
            )
        if isinstance(callback, BaseFinetuning) and _breaks_finetuning(module, dims):
            raise ValueError(
                f"{type(callback).__name__} (BaseFinetuning) cannot unfreeze under MegaScaleStrategy at {layout}: "
                "its unfreeze_and_add_param_group compares every parameter by value with torch.equal, which fails "
                "between the tensor- or expert-parallel shards (DTensors) and the plain or otherwise sharded "
                "parameters this model holds, and deadlocks between sharded parameters of pipeline stages. In "
                "finetune_function unfreeze by hand instead: `for p in modules.parameters(): p.requires_grad_(True)` "
                "then `optimizer.add_param_group({'params': [those parameters], 'lr': ...})` (works under every "
                "layout), or use tp=1 and ep=1 (and, with pp > 1, zero_stage 0 or 1)"
            )
    readers = gradient_readers(trainer)
    if readers and dims.pp > 1:
        rank_zero_warn(
            f"MegaScaleStrategy: {readers} may read gradients before the optimizer step; with pp={dims.pp} each rank "
            "holds its pipeline stage's gradients only, so a norm taken there (Lightning's grad_norm, "
            "torch.nn.utils.clip_grad_norm_) covers this stage only. For the whole model's, log "
            "megascale.lightning.grad_norm(self, 2) and clip with gradient_clip_val or self.clip_gradients(...)"
        )
    if not module.automatic_optimization and dims.pp > 1:
        raise ValueError(
            f"manual optimization (automatic_optimization=False) cannot run with pipeline parallelism ({layout}): "
            "a pipeline step runs the forward and backward of every microbatch inside training_step, so steps by "
            "hand cannot be interleaved with it. Use pp=1 (tp and ZeRO work with manual optimization), or "
            "automatic optimization"
        )


def _breaks_finetuning(module: nn.Module, dims: ParallelDims) -> bool:
    """DTensor and plain parameters mixed, or DTensors of several meshes (torch.equal raises on both), or
    DTensor parameters under pp (torch.equal on sharded parameters is a collective: the ranks were seen
    stopping in different ones, a deadlock)."""
    meshes = {p.device_mesh if is_dtensor(p) else None for p in module.parameters()}  # type: ignore[attr-defined]
    return len(meshes) > 1 or (dims.pp > 1 and meshes != {None})
