"""megascale-lightning: MegaScaleStrategy (tensor, pipeline and ZeRO data parallelism) inside PyTorch Lightning.

GPTModule (megascale-core's GPT as a LightningModule), TokenDataModule (stdlib / text / synthetic tokens with an
exactly resumable data-parallel sampler), and the `megascale` LightningCLI command (megascale.lightning.cli).
"""

from importlib.metadata import PackageNotFoundError, version

# Public names are re-exported with `as` (explicit re-exports for ruff and mypy): adding one is one line.
from megascale.lightning.data import TokenDataModule as TokenDataModule
from megascale.lightning.module import GPTModule as GPTModule
from megascale.lightning.strategy import MegaScaleStrategy as MegaScaleStrategy

try:
    __version__ = version("megascale-lightning")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"
