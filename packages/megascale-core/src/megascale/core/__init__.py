"""megascale-core: parallel transformer blocks, tensor/sequence-parallel layers, fused kernels and LAMB.

from megascale.core import GPT, GPTConfig
model = GPT(GPTConfig(vocab_size=256, d_model=256, n_layers=4, n_heads=4))
loss = model(tokens, targets)
"""

from importlib.metadata import PackageNotFoundError, version

from megascale.core.config import GPTConfig
from megascale.core.model import GPT, flops_per_token, generate
from megascale.core.parallel import apply_activation_checkpointing, apply_tensor_parallel

try:
    __version__ = version("megascale-core")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "GPT",
    "GPTConfig",
    "__version__",
    "apply_activation_checkpointing",
    "apply_tensor_parallel",
    "flops_per_token",
    "generate",
]
