"""apply_context_parallel: a megascale GPT whose ranks each hold two chunks of every sequence.

The model keeps taking whole sequences — every cp rank of a replica is given the same ones, as its data
loader already does (ranks are sampled by their dp coordinate) — and works on its own chunks: the embedding
keeps the rank's chunks of the token ids (a forward pre-hook), the loss those of the targets (``loss.py``,
which also makes it the whole sequence's mean). With packed documents the chunks are dealt by the step's
documents (``balance.py``): a forward pre-hook on the model notes its ``position_ids`` for the step. So a Lightning module, a pipeline schedule or a loop of your
own runs unchanged; only logits returned without targets are the rank's chunks (``sharding.positions`` says
where they sit). In between, only what mixes tokens changes: every attention core gets a ``ContextParallel``
(rotary angles at the rank's positions, the keys/values it lacks brought in); norms, MLPs and the head work
token by token on the local chunks. Parameters are the same on every cp rank: their gradients are averaged over
dp × cp by ZeRO (``parallelize`` hands it the flattened ("dp", "cp") mesh).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from megascale.core.model.attention import SelfAttention
from megascale.core.model.gpt import GPT
from megascale.core.model.moe import MoE
from megascale.core.parallel.cp.attention import ContextParallel
from megascale.core.parallel.cp.balance import LayoutOfStep
from megascale.core.parallel.cp.loss import ContextParallelLoss
from megascale.core.parallel.tp.comm import SequenceSplitOverMesh

__all__ = ["apply_context_parallel", "check_context_parallel"]


def check_context_parallel(config: object, cp: int) -> None:
    """Raise ValueError for what a GPT of ``config`` cannot do under ``cp`` context-parallel ranks."""
    dropout = getattr(config, "dropout", 0.0)
    if cp > 1 and dropout > 0:
        raise ValueError(
            f"dropout={dropout} with cp={cp}: context parallelism does not give each rank its own dropout stream "
            "yet, so the ranks' masks would be correlated; set dropout=0 or cp=1"
        )


def _keep_blocks(step: LayoutOfStep, rank: int) -> Callable[[nn.Module, tuple[Any, ...]], tuple[Any, ...]]:
    def hook(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        tokens, *rest = args
        return (step.layout(tokens.shape[1]).shard(tokens, rank), *rest)

    return hook


def _note_positions(step: LayoutOfStep) -> Callable[..., None]:
    """A forward pre-hook on the model: the step's packed documents (its ``position_ids``), or none."""

    def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        step.position_ids = kwargs.get("position_ids", args[2] if len(args) > 2 else None)

    return hook


def apply_context_parallel(model: GPT, cp_mesh: DeviceMesh) -> GPT:
    """Make ``model`` (tensor-parallel already, or not) run on its rank's chunks: see the module docstring.

    It still takes whole sequences (see the module docstring); their lengths must be multiples of 2·cp
    (times tp under sequence parallelism: ``model.sequence_multiple``)."""
    if cp_mesh.ndim != 1:
        raise ValueError(f"apply_context_parallel needs a 1-D cp mesh; got {cp_mesh.ndim} dimensions")
    cp = cp_mesh.size()
    check_context_parallel(model.config, cp)
    if cp == 1:
        return model
    group = cp_mesh.get_group()
    rank = cp_mesh.get_local_rank()
    step = LayoutOfStep(cp)  # balanced by the step's packed documents, for every piece below
    model.register_forward_pre_hook(_note_positions(step), with_kwargs=True)
    for m in model.modules():
        if isinstance(m, SelfAttention):
            m.context_parallel = ContextParallel(group, rank, cp, step=step)
        if isinstance(m, MoE):  # routes whole sequences (gathered over cp), as one process does
            m.context_parallel_split = SequenceSplitOverMesh(cp_mesh, grad_scale=float(cp))
    if model.embed is not None:  # the first pipeline stage, or the whole model
        model.embed.register_forward_pre_hook(_keep_blocks(step, rank))
    model.loss_fn = ContextParallelLoss(model.loss_fn, group, step=step)
    model.sequence_multiple = model.sequence_multiple * 2 * cp
    return model
