"""One small module per corpus format (`tar`, `parquet`, `jsonl`), behind the protocol in `base`, each
registering itself there when this package imports it.

Sources, mixing, lanes, exact and elastic resume, tree loading and bad-input handling are the same for every
format: they see units and samples only (see `base`).
"""

from megascale.data.formats import jsonl, parquet, tar  # noqa: F401  (each registers itself; pyarrow on use)
from megascale.data.formats.base import FORMATS, Format, ReadCursor, format_of, load, register, split_unit

__all__ = ["FORMATS", "Format", "ReadCursor", "format_of", "load", "register", "split_unit"]
