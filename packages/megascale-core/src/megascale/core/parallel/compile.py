"""torch.compile per block: each block of the model compiled in place, once the layout is applied.

As torchtitan does, the blocks (the repeated unit; blocks of one class share their compiled code) are
compiled rather than the whole model: the pipeline's schedule, ZeRO's hooks and what runs between blocks stay
in eager Python. ``nn.Module.compile`` compiles in place, so parameter names, checkpoints and the resumes
between layouts are the same with it on or off. The blocks are those a model lists in ``pipeline_layers()``
(a pipeline rank's own under pp); a model listing none is refused by name. ``parallelize`` compiles after the
tensor-parallel split and activation checkpointing (a recomputed block is compiled with its recomputation)
and before ZeRO, whose hooks then run around the compiled blocks. Dropout draws other masks compiled than
eager (inductor's own random numbers): compiled runs are compared with eager ones without dropout.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from megascale.core.model.layers import pipeline_layers_of

__all__ = ["compile_blocks", "compile_targets"]


def compile_targets(model: nn.Module) -> list[nn.Module]:
    """The blocks that modules of ``model`` list in ``pipeline_layers()``, each once. Raises ValueError, naming
    the model, if there are none (``parallelize`` asks before anything is split)."""
    blocks = [
        b for m in model.modules() if (layers := pipeline_layers_of(m)) is not None for b in layers.blocks
    ]
    found = list({id(b): b for b in blocks}.values())
    if not found:
        raise ValueError(
            f"compile=True compiles the blocks a model lists in pipeline_layers(), and {type(model).__name__} lists "
            "none: give the model pipeline_layers() (first / blocks / last), or compile inside your own model "
            "(e.g. block.compile() in configure_model) and leave compile off"
        )
    return found


def compile_blocks(model: nn.Module, blocks: Sequence[nn.Module] | None = None) -> list[nn.Module]:
    """Compile ``blocks`` (default: ``compile_targets(model)``; a pipeline rank passes its stages' own) in
    place with ``nn.Module.compile``; returns them."""
    found = compile_targets(model) if blocks is None else list({id(b): b for b in blocks}.values())
    for block in found:
        block.compile()
    return found
