"""PipelineLayers: a model's layers in order, the one thing parallelism needs to know about its shape.

A model offers them by a method ``pipeline_layers()`` (a megascale GPT does; a user's model may), returning
``PipelineLayers`` or simply its sequence of blocks (an ``nn.ModuleList``). Calling every layer in turn on the
model's inputs must compute the model's output: the first layers take the inputs (token ids), each later
one the previous one's output (one tensor), and the last give what ``pipeline_loss(output, target)`` reads.

Who uses them: pipeline parallelism cuts the blocks into stages (the first layers go with the first stage,
the last ones with the last); ZeRO-2/3 make each group of blocks one FSDP unit and ZeRO-1 waits for a block's
updated parameters just before its forward; ``activation_checkpointing="full"`` recomputes each block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

__all__ = ["PipelineLayers", "pipeline_layers_of"]


@dataclass
class PipelineLayers:
    """The ordered layers of a model: ``first`` (e.g. the embedding), ``blocks`` (the repeated layers, which
    a pipeline cuts into stages) and ``last`` (e.g. the final norm and the output head)."""

    blocks: list[nn.Module]
    first: list[nn.Module] = field(default_factory=list)
    last: list[nn.Module] = field(default_factory=list)

    def __post_init__(self) -> None:
        # None entries are left out: layers a pipeline rank does not hold (pruned attributes)
        self.blocks = [m for m in self.blocks if m is not None]
        self.first = [m for m in self.first if m is not None]
        self.last = [m for m in self.last if m is not None]
        for part in ("first", "blocks", "last"):
            for layer in getattr(self, part):
                if not isinstance(layer, nn.Module):
                    raise TypeError(f"PipelineLayers.{part} holds a {type(layer).__name__}, not an nn.Module")

    def all(self) -> list[nn.Module]:
        """Every layer, in forward order."""
        return [*self.first, *self.blocks, *self.last]


def pipeline_layers_of(module: nn.Module) -> PipelineLayers | None:
    """``module.pipeline_layers()`` as ``PipelineLayers`` (a plain sequence counts as the blocks), or None
    when the module offers no such method."""
    method = getattr(module, "pipeline_layers", None)
    if not callable(method):
        return None
    layers = method()
    if isinstance(layers, PipelineLayers):
        return layers
    if isinstance(layers, Sequence | nn.ModuleList):
        return PipelineLayers(blocks=list(layers))
    raise TypeError(
        f"{type(module).__name__}.pipeline_layers() returned a {type(layers).__name__}: return "
        "megascale.core.model.PipelineLayers(first=..., blocks=..., last=...) or a sequence of blocks"
    )
