"""megascale-lightning: MegaScaleStrategy (tensor, pipeline and ZeRO data parallelism) inside PyTorch Lightning.

The strategy, GPTModule and LightningCLI entry point land with the strategy issue; this package exists now so
that its install (megascale-core pinned to the same version, lightning, jsonargparse) is tested à la carte.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("megascale-lightning")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
