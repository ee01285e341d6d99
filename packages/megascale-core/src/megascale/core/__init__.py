"""megascale-core: parallel transformer blocks, tensor/sequence-parallel layers, fused kernels and LAMB.

from megascale.core import GPT, GPTConfig
model = GPT(GPTConfig(vocab_size=256, d_model=256, n_layers=4, n_heads=4))
loss = model(tokens, targets)
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from megascale.core._lazy import lazy_exports

if TYPE_CHECKING:
    from megascale.core.config import GPTConfig as GPTConfig
    from megascale.core.config import MoEConfig as MoEConfig
    from megascale.core.model import GPT as GPT
    from megascale.core.model import flops_per_token as flops_per_token
    from megascale.core.model.generate import generate as generate
    from megascale.core.parallel import apply_activation_checkpointing as apply_activation_checkpointing
    from megascale.core.parallel import apply_tensor_parallel as apply_tensor_parallel

try:
    __version__ = version("megascale-core")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

# Imported on first use (PEP 562), so a submodule that needs no torch (the console scripts' error helper, the
# planner's tables) is cheap to import: `megascale --help` answers without importing torch.
_LAZY = {
    "GPT": "megascale.core.model",
    "GPTConfig": "megascale.core.config",
    "MoEConfig": "megascale.core.config",
    "apply_activation_checkpointing": "megascale.core.parallel",
    "apply_tensor_parallel": "megascale.core.parallel",
    "flops_per_token": "megascale.core.model",
    "generate": "megascale.core.model.generate",
}
__all__ = ["__version__", *_LAZY]

lazy_exports(__name__, _LAZY)
