"""megascale-data: asynchronous WebDataset loading with tree-based shared-memory loading and exact resume.

Works without megascale-core and without Lightning (a LightningDataModule comes with the `lightning` extra).
The loader lands with the data issue; this package exists now so its à-la-carte install is tested.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("megascale-data")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
