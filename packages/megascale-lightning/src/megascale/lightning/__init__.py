"""megascale-lightning: MegaScaleStrategy (tensor, pipeline and ZeRO data parallelism) inside PyTorch Lightning.

GPTModule (megascale-core's GPT as a LightningModule), TokenDataModule (stdlib / text / synthetic tokens with an
exactly resumable data-parallel sampler), SpeedMonitor (tokens/s and MFU on any device), RunSummary (a sample
from the trained model and the loss curve over restarts at the end of a run), and the `megascale` LightningCLI
command (megascale.lightning.cli).
"""

from importlib.metadata import PackageNotFoundError, version

# Public names are re-exported with `as` (explicit re-exports for ruff and mypy): adding one is one line.
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
