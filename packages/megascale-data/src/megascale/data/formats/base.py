"""What every format module gives the reader, the registry they join, and how a URL finds its format (no torch,
no pyarrow here).

A format reads one *unit* of a file as a stream of samples (``{"__key__", "__url__", text_key: bytes}``,
WebDataset's shape, so preprocessing and packing are the same for every format) from a `ReadCursor` on. A
unit is what the canonical order deals out to lanes and what a resume position counts in: a whole file for
tar and JSONL, one row group of a Parquet file (so a lane fetches only the row groups it reads). A unit of a
Parquet file is named ``<file url>#row_group=<k>``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fsspec.spec import AbstractFileSystem

__all__ = ["FORMATS", "Format", "ReadCursor", "format_of", "load", "register", "split_unit"]

FORMATS = ("tar", "parquet", "jsonl")
_UNIT = re.compile(r"^(.*)#row_group=(\d+)$")
_REGISTERED: dict[str, Format] = {}


class ReadCursor:
    """Where a retry resumes: samples yielded so far, and (tar only) the byte offset of the first sample not
    yet yielded when the shard is an uncompressed, seekable tar (otherwise a retry re-reads and skips)."""

    def __init__(self) -> None:
        self.done = 0
        self.offset = 0
        self.seekable = False
        self.pending = False  # a sample has members read but is not yet yielded


@dataclass(frozen=True)
class Format:
    """One format: how it reads a unit, which errors mean the file is damaged, its default text key."""

    name: str
    read: Callable[[AbstractFileSystem, str, str, ReadCursor, str], Iterator[dict[str, Any]]]
    # the errors that mean a damaged file; a function, as they may come from an optional extra (pyarrow)
    corrupt_errors: Callable[[], tuple[type[BaseException], ...]]
    default_text_key: str

    @property
    def corrupt(self) -> tuple[type[BaseException], ...]:
        return self.corrupt_errors()


def split_unit(url: str) -> tuple[str, int | None]:
    """``(file url, row group)`` of a unit name; the row group is None for a whole-file unit."""
    match = _UNIT.match(url)
    return (match.group(1), int(match.group(2))) if match else (url, None)


def format_of(url: str, explicit: str | None = None) -> str:
    """The format of a file: ``explicit`` if given, else by extension (``.parquet``; ``.jsonl``, ``.json``,
    ``.jsonl.zst``, ``.jsonl.gz``, ``.zst``; anything else is a tar shard, WebDataset's and the default)."""
    if explicit is not None:
        if explicit not in FORMATS:
            raise ValueError(f"format {explicit!r} is not one of {', '.join(FORMATS)}")
        return explicit
    name = split_unit(url)[0].lower()
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith((".jsonl", ".json", ".jsonl.zst", ".jsonl.gz", ".json.zst", ".zst", ".ndjson")):
        return "jsonl"
    return "tar"


def register(fmt: Format) -> Format:
    """Make ``fmt`` what ``load(fmt.name)`` returns; each format module registers itself when imported."""
    if fmt.name not in FORMATS:
        raise ValueError(f"format {fmt.name!r} is not one of {', '.join(FORMATS)}")
    _REGISTERED[fmt.name] = fmt
    return fmt


def load(name: str) -> Format:
    """The registered format ``name`` (the package ``megascale.data.formats`` imports every format module)."""
    if name not in _REGISTERED:
        raise ValueError(f"format {name!r} is not one of {', '.join(sorted(_REGISTERED))}")
    return _REGISTERED[name]
