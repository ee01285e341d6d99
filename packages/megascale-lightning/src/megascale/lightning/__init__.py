"""megascale-lightning: MegaScaleStrategy (tensor, pipeline and ZeRO data parallelism) inside PyTorch Lightning.

GPTModule (megascale-core's GPT as a LightningModule), TokenDataModule (stdlib / text / synthetic tokens with an
exactly resumable data-parallel sampler), SpeedMonitor (tokens/s and MFU on any device), RunSummary (a sample
from the trained model and the loss curve over restarts at the end of a run), and the `megascale` LightningCLI
command (megascale.lightning.cli).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from megascale.core._lazy import lazy_exports

if TYPE_CHECKING:
    from megascale.lightning.data import TokenDataModule as TokenDataModule
    from megascale.lightning.grad_norm import grad_norm as grad_norm
    from megascale.lightning.module import GPTModule as GPTModule
    from megascale.lightning.speed import SpeedMonitor as SpeedMonitor
    from megascale.lightning.strategy import MegaScaleStrategy as MegaScaleStrategy
    from megascale.lightning.summary import RunSummary as RunSummary

try:
    __version__ = version("megascale-lightning")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

# Imported on first use (PEP 562): `megascale --help`, `megascale configs` and a mistyped command answer without
# importing Lightning (~8 s of CPU). A public name is one line here and one above.
_LAZY = {
    "GPTModule": "megascale.lightning.module",
    "MegaScaleStrategy": "megascale.lightning.strategy",
    "RunSummary": "megascale.lightning.summary",
    "SpeedMonitor": "megascale.lightning.speed",
    "TokenDataModule": "megascale.lightning.data",
    "grad_norm": "megascale.lightning.grad_norm",
}
__all__ = ["__version__", *_LAZY]

lazy_exports(__name__, _LAZY)
