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
- ``BaseFinetuning.unfreeze_and_add_param_group`` leaves out parameters already in the optimizer by comparing
  values (``torch.equal``) with every optimizer parameter, which raises for a DTensor against a plain tensor,
  and is a collective over the whole world between sharded ones, which deadlocked across pipeline stages:
  each such callback is given a filter that decides what one process would (`megascale.lightning.finetuning`),
  under every layout.
"""

from __future__ import annotations

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BaseFinetuning, StochasticWeightAveraging
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed import ProcessGroup

from megascale.core.parallel.mesh import ParallelDims
from megascale.lightning import finetuning
from megascale.lightning.weight_readers import gradient_readers, gradient_readers_after_step

__all__ = ["check_trainer_features"]


def _layout(dims: ParallelDims, zero_stage: int, ep: int = 1) -> str:
    cp = f" × cp={dims.cp}" if dims.cp > 1 else ""
    experts = f", experts split over ep={ep} of the dp ranks" if ep > 1 else ""
    return f"dp={dims.dp} × pp={dims.pp}{cp} × tp={dims.tp}, ZeRO stage {zero_stage}{experts}"


def check_trainer_features(
    trainer: Trainer,
    module: LightningModule,
    dims: ParallelDims,
    zero_stage: int,
    ep: int = 1,
    pp_group: ProcessGroup | None = None,
) -> None:
    """Refuse (ValueError) what the layout cannot do for this fit's callbacks and module; adapt what it can.
    Called once the model is split, before the first step; ``pp_group``: the pipeline stages' (pp > 1)."""
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
        if isinstance(callback, BaseFinetuning):
            finetuning.adapt(callback, pp_group)
    readers = gradient_readers(trainer) + gradient_readers_after_step(trainer)
    if readers and dims.pp > 1:
        rank_zero_warn(
            f"MegaScaleStrategy: {readers} may read gradients; with pp={dims.pp} each rank "
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
    datamodule = getattr(trainer, "datamodule", None)
    if getattr(datamodule, "document_mask", False):
        what = f"{type(datamodule).__name__}(document_mask=True)"
        check_packed_documents(what, module, dims, zero_stage, ep)


def check_packed_documents(
    what: str, module: nn.Module, dims: ParallelDims, zero_stage: int, ep: int = 1
) -> None:
    """Refuse (ValueError) packed documents' ``position_ids`` (``what`` brings them) under pipeline parallelism
    for a model whose blocks do not take them (megascale's GPT does: ``blocks_take_position_ids``)."""
    pipelined = [m for m in module.modules() if hasattr(m, "_megascale_pipeline")]
    refusing = [
        type(m).__name__.removeprefix("Pipelined")
        for m in pipelined
        if not getattr(m, "blocks_take_position_ids", False)
    ]
    if dims.pp > 1 and refusing:
        raise ValueError(
            f"{what} cannot run at {_layout(dims, zero_stage, ep)}: each pipeline stage hands its microbatch's "
            f"position_ids to the blocks as their second input, and {refusing[0]} does not declare "
            "blocks_take_position_ids = True (blocks called as block(x, position_ids)). Declare it, use pp=1, "
            "or batches without position_ids (document_mask=False)"
        )
