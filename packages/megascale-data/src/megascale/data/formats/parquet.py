"""Parquet corpora (pyarrow): the text in a column chosen by name; the resumable unit is a row group.

Only the footer and the text column's chunks of the row groups a lane reads are fetched: the file is opened
through fsspec without read-ahead caching (remote filesystems), so pyarrow's reads become byte-range
requests of exactly the column chunk it needs, not the whole file. `row_groups` (at listing time) reads the
footer only and checks the column, so a missing text column fails before training starts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fsspec.spec import AbstractFileSystem

from megascale.data.formats.base import Format, ReadCursor, register

__all__ = ["DEFAULT_TEXT_KEY", "FORMAT", "corrupt_errors", "read", "row_groups"]

DEFAULT_TEXT_KEY = "text"


def _pq() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError("reading Parquet needs `pyarrow`: pip install 'megascale-data[parquet]'") from e
    return pq


class CorruptParquetError(ValueError):
    """pyarrow could not decode a row group (it reports that as a bare OSError, like an I/O failure)."""


def corrupt_errors() -> tuple[type[BaseException], ...]:
    import pyarrow as pa

    return (pa.ArrowInvalid, pa.ArrowNotImplementedError, EOFError, CorruptParquetError)


def _open(fs: AbstractFileSystem, path: str) -> Any:
    local = "file" in ((fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol))
    # no block cache remotely: every read pyarrow issues is one exact range request
    return fs.open(path, "rb") if local else fs.open(path, "rb", cache_type="none")


def row_groups(fs: AbstractFileSystem, path: str, url: str, text_key: str) -> int:
    """Row groups of a Parquet file (its footer only), after checking that it has the text column."""
    pq = _pq()
    with _open(fs, path) as f:
        try:
            meta = pq.ParquetFile(f).metadata
        except Exception as e:
            raise ValueError(f"{url} is not a readable Parquet file: {type(e).__name__}: {e}") from e
    names = meta.schema.names
    if text_key not in names:
        raise ValueError(
            f"{url} has no column {text_key!r} (columns: {', '.join(names)}): set the source's text_key to the "
            "column holding the text"
        )
    return int(meta.num_row_groups)


def read(
    fs: AbstractFileSystem, path: str, url: str, cur: ReadCursor, text_key: str
) -> Iterator[dict[str, Any]]:
    """The rows of one row group (``url`` ends with ``#row_group=<k>``) from ``cur`` on."""
    from megascale.data.formats.base import split_unit

    _, group = split_unit(url)
    pq = _pq()
    with _open(fs, path) as f:
        try:
            table = pq.ParquetFile(f).read_row_group(group or 0, columns=[text_key])
        except OSError as e:
            # a bare OSError without errno is pyarrow's decoding failure ("Couldn't deserialize thrift"):
            # damage, not a transient failure to retry; network and file errors keep their own types
            if type(e) is OSError and e.errno is None:
                raise CorruptParquetError(str(e).strip()) from e
            raise
    column = table.column(text_key).to_pylist()
    for index in range(cur.done, len(column)):
        text = column[index]
        sample: dict[str, Any] = {"__key__": f"{index:09d}", "__url__": url}
        if isinstance(text, str):
            sample[text_key] = text.encode("utf-8")
        elif isinstance(text, bytes):
            sample[text_key] = text
        yield sample


FORMAT = register(Format("parquet", read, corrupt_errors, DEFAULT_TEXT_KEY))
