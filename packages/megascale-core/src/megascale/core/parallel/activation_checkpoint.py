"""Activation checkpointing: keep a block's input, recompute its inside during backward.

"full" recomputes every block (activation memory of one block input per layer); "selective" recomputes
only the attention core — the softmax inputs and probabilities, quadratic in sequence length, which are the
largest activations for their compute (Korthikanti et al. 2022, "Reducing Activation Recomputation").

What a block is: the blocks a model lists in ``pipeline_layers()`` (a megascale GPT's, or a user model's;
``megascale.core.model.layers``), or, given ``targets``, every module whose class name or qualified name
matches one of them (``fnmatch`` patterns: ``"MyBlock"``, ``"model.layers.*"``). "selective" needs a megascale
GPT (its ``SelfAttention`` cores) or ``targets``. A mode that finds nothing to recompute is an error.

torch's composable ``checkpoint`` is used because it leaves parameter names unchanged (no wrapper module),
so checkpoints and FSDP2 see the same model with it on or off.
"""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase
from typing import Literal

from torch import nn
from torch.distributed._composable import checkpoint

from megascale.core.model.attention import SelfAttention
from megascale.core.model.layers import pipeline_layers_of
from megascale.core.parallel.rng import ModelParallelRNG

__all__ = ["ActivationCheckpointMode", "apply_activation_checkpointing", "checkpoint_targets"]

ActivationCheckpointMode = Literal["none", "full", "selective"]


def checkpoint_targets(
    model: nn.Module,
    mode: ActivationCheckpointMode,
    targets: Sequence[str] = (),
    blocks: Sequence[nn.Module] | None = None,
) -> list[nn.Module]:
    """The modules ``apply_activation_checkpointing`` would recompute (outermost only; see the module
    docstring); ``blocks``, when given, are the blocks of "full" (a pipeline rank's). Raises ValueError,
    naming the model, when the mode finds none."""
    if mode not in ("none", "full", "selective"):
        raise ValueError(f"activation checkpointing mode {mode!r} must be 'none', 'full' or 'selective'")
    if mode == "none":
        return []
    found: list[nn.Module] = []
    if targets:
        for name, module in model.named_modules():
            if any(fnmatchcase(type(module).__name__, t) or fnmatchcase(name, t) for t in targets):
                found.append(module)
        what = f"checkpoint_modules={list(targets)}"
    elif mode == "full" and blocks is not None:
        found = list(blocks)
        what = "activation_checkpointing='full' (the blocks listed by pipeline_layers())"
    elif mode == "full":
        for module in model.modules():
            layers = pipeline_layers_of(module)
            if layers is not None:
                found.extend(layers.blocks)
        what = "activation_checkpointing='full' (the blocks listed by pipeline_layers())"
    else:
        found = [m for m in model.modules() if isinstance(m, SelfAttention)]
        what = "activation_checkpointing='selective' (megascale SelfAttention cores)"
    # outermost only, each once: checkpointing a module inside a checkpointed one would recompute it twice
    unique = list({id(m): m for m in found}.values())
    inner = {id(sub) for m in unique for sub in m.modules() if sub is not m}
    found = [m for m in unique if id(m) not in inner]
    if not found:
        raise ValueError(
            f"{what} found nothing to recompute in {type(model).__name__}: give the model pipeline_layers() "
            "listing its blocks, or name them with checkpoint_modules (class names or module-name patterns, "
            "e.g. ['MyBlock'] or ['model.layers.*'])"
        )
    return found


def apply_activation_checkpointing(
    model: nn.Module,
    mode: ActivationCheckpointMode,
    targets: Sequence[str] = (),
    blocks: Sequence[nn.Module] | None = None,
    rng: ModelParallelRNG | None = None,
) -> nn.Module:
    """Checkpoint the blocks ("full") or attention cores ("selective") of ``model`` in place, or the modules
    ``targets`` name; see the module docstring and ``checkpoint_targets``. With ``rng`` (tensor-parallel
    dropout streams), a recomputation draws the same masks as the forward it replays."""
    kwargs = {"context_fn": rng.checkpoint_context} if rng is not None else {}
    for module in checkpoint_targets(model, mode, targets, blocks):
        checkpoint(module, **kwargs)
    return model
