"""megascale-data: asynchronous WebDataset loading with tree-based shared-memory loading and exact resume.

Works without megascale-core and without Lightning (`WebDataModule` comes with the `lightning` extra).
Names are imported on first use, so `import megascale.data` stays light (reader processes import only
what they run, never torch).
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("megascale-data")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

_EXPORTS = {
    "CanonicalOrder": "megascale.data.order",
    "CorruptShardError": "megascale.data.sources",
    "DataSourceError": "megascale.data.sources",
    "ShardNotFoundError": "megascale.data.sources",
    "ShardReadError": "megascale.data.sources",
    "Source": "megascale.data.sources",
    "StdlibShards": "megascale.data.stdlib",
    "WebDataConfig": "megascale.data.config",
    "WebDataModule": "megascale.data.datamodule",
    "WebLoader": "megascale.data.loader",
    "build_stdlib_shards": "megascale.data.stdlib",
    "load_tokenizer": "megascale.data.tokenize",
    "train_stdlib_bpe": "megascale.data.bpe",
    "merge_states": "megascale.data.loader",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:
    from megascale.data.bpe import train_stdlib_bpe as train_stdlib_bpe
    from megascale.data.config import WebDataConfig as WebDataConfig
    from megascale.data.datamodule import WebDataModule as WebDataModule
    from megascale.data.loader import WebLoader as WebLoader
    from megascale.data.loader import merge_states as merge_states
    from megascale.data.order import CanonicalOrder as CanonicalOrder
    from megascale.data.sources import CorruptShardError as CorruptShardError
    from megascale.data.sources import DataSourceError as DataSourceError
    from megascale.data.sources import ShardNotFoundError as ShardNotFoundError
    from megascale.data.sources import ShardReadError as ShardReadError
    from megascale.data.sources import Source as Source
    from megascale.data.stdlib import StdlibShards as StdlibShards
    from megascale.data.stdlib import build_stdlib_shards as build_stdlib_shards
    from megascale.data.tokenize import load_tokenizer as load_tokenizer


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'megascale.data' has no attribute {name!r}")
