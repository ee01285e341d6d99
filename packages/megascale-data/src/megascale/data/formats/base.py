"""What every format module gives the reader, and how a URL finds its format (no torch, no pyarrow here).

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

__all__ = ["FORMATS", "Format", "ReadCursor", "format_of", "split_unit"]

FORMATS = ("tar", "parquet", "jsonl")
_UNIT = re.compile(r"^(.*)#row_group=(\d+)$")


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
    corrupt: tuple[type[BaseException], ...]
    default_text_key: str


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


def load(name: str) -> Format:
    """The format module's reader (imported on first use: pyarrow and zstandard are optional extras)."""
    if name == "tar":
        from megascale.data.formats import tar

        return Format("tar", tar.read, tar.CORRUPT, tar.DEFAULT_TEXT_KEY)
    if name == "jsonl":
        from megascale.data.formats import jsonl

        return Format("jsonl", jsonl.read, jsonl.corrupt_errors(), jsonl.DEFAULT_TEXT_KEY)
    if name == "parquet":
        from megascale.data.formats import parquet

        return Format("parquet", parquet.read, parquet.corrupt_errors(), parquet.DEFAULT_TEXT_KEY)
    raise ValueError(f"format {name!r} is not one of {', '.join(FORMATS)}")
