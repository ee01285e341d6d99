"""Activation checkpointing: keep a block's input, recompute its inside during backward.

"full" recomputes every block (activation memory of one block input per layer); "selective" recomputes
only the attention core — the softmax inputs and probabilities, quadratic in sequence length, which are the
largest activations for their compute (Korthikanti et al. 2022, "Reducing Activation Recomputation").
torch's composable ``checkpoint`` is used because it leaves parameter names unchanged (no wrapper module),
so checkpoints and FSDP2 see the same model with it on or off.
"""

from __future__ import annotations

from typing import Literal

from torch import nn
from torch.distributed._composable import checkpoint

from megascale.core.model.attention import SelfAttention
from megascale.core.model.gpt import GPT

__all__ = ["ActivationCheckpointMode", "apply_activation_checkpointing"]

ActivationCheckpointMode = Literal["none", "full", "selective"]


def apply_activation_checkpointing(model: GPT, mode: ActivationCheckpointMode) -> GPT:
    """Checkpoint each block ("full") or each attention core ("selective") of ``model``, in place."""
    if mode not in ("none", "full", "selective"):
        raise ValueError(f"activation checkpointing mode {mode!r} must be 'none', 'full' or 'selective'")
    targets: list[nn.Module] = []
    if mode == "full":
        targets = list(model.blocks.values())
    elif mode == "selective":
        targets = [m for m in model.modules() if isinstance(m, SelfAttention)]
    for module in targets:
        checkpoint(module)
    return model
