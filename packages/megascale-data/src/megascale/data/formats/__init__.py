"""One small module per corpus format (`tar`, `parquet`, `jsonl`), behind the protocol in `base`.

Sources, mixing, lanes, exact and elastic resume, tree loading and bad-input handling are the same for every
format: they see units and samples only (see `base`).
"""

from megascale.data.formats.base import FORMATS, Format, ReadCursor, format_of, load, split_unit

__all__ = ["FORMATS", "Format", "ReadCursor", "format_of", "load", "split_unit"]
