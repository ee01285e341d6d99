"""JSON Lines corpora (``.jsonl``, optionally ``.zst`` or ``.gz`` compressed): one document per line, the text
in a field chosen by name, streamed (never the whole file in memory). The resumable unit is the file.

A line that is not valid UTF-8 JSON, or not an object, is skipped and counted (like a tar sample without its
text member); damage to the compression (a truncated ``.zst``/``.gz``) ends the file as a corrupt shard does.
"""

from __future__ import annotations

import gzip
import io
import json
import zlib
from collections.abc import Iterator
from typing import Any

from fsspec.spec import AbstractFileSystem

from megascale.data.formats.base import Format, ReadCursor, register

__all__ = ["DEFAULT_TEXT_KEY", "FORMAT", "TruncatedError", "corrupt_errors", "read"]

DEFAULT_TEXT_KEY = "text"


def corrupt_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [EOFError, zlib.error, gzip.BadGzipFile, TruncatedError]
    try:
        import zstandard

        errors.append(zstandard.ZstdError)
    except ImportError:
        pass
    return tuple(errors)


class TruncatedError(EOFError):
    """A compressed file ends inside a frame."""


def _zstd_chunks(raw: Any, name: str) -> Iterator[bytes]:
    """Decompressed chunks of a zstd file of one or more frames. zstandard's stream reader ends a truncated
    frame quietly (no error, the frame's data lost), so frames are followed here and an unfinished one raised."""
    try:
        import zstandard
    except ImportError as e:
        raise ImportError(
            f"{name} is zstd-compressed: reading it needs `zstandard` (pip install 'megascale-data[zstd]')"
        ) from e
    frame = zstandard.ZstdDecompressor().decompressobj()
    started = False
    while chunk := raw.read(1 << 20):
        while chunk:
            started = True
            out = frame.decompress(chunk)
            if out:
                yield out
            if not frame.eof:
                break
            chunk, frame, started = frame.unused_data, zstandard.ZstdDecompressor().decompressobj(), False
    if started:
        raise TruncatedError(f"{name} ends inside a zstd frame (truncated)")


def _lines(raw: Any, name: str) -> Iterator[bytes]:
    lowered = name.lower()
    if lowered.endswith(".zst"):
        tail = b""
        for chunk in _zstd_chunks(raw, name):
            *lines, tail = (tail + chunk).split(b"\n")
            yield from lines
        if tail:
            yield tail
        return
    stream = gzip.GzipFile(fileobj=raw) if lowered.endswith(".gz") else raw
    yield from io.BufferedReader(stream, buffer_size=1 << 20)


def read(
    fs: AbstractFileSystem, path: str, url: str, cur: ReadCursor, text_key: str
) -> Iterator[dict[str, Any]]:
    """The documents of a JSONL file from ``cur`` on, as samples ``{text_key: UTF-8 bytes}``."""
    with fs.open(path, "rb") as raw:
        index = -1
        for line in _lines(raw, path):
            if not line.strip():
                continue
            index += 1
            if index < cur.done:
                continue  # a retry re-reads the file and skips what was yielded
            sample: dict[str, Any] = {"__key__": f"{index:09d}", "__url__": url}
            try:
                record = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                record = None
            # a sample without its text (bad line, no such field) is skipped and counted by the lane reader
            if isinstance(record, dict) and isinstance(record.get(text_key), str):
                sample[text_key] = record[text_key].encode("utf-8")
            yield sample


FORMAT = register(Format("jsonl", read, corrupt_errors, DEFAULT_TEXT_KEY))
