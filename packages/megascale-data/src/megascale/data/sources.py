"""Where training text comes from: WebDataset tar shards, Parquet and JSONL(.zst) files on local disk, S3 or
any fsspec filesystem.

Scope: naming files (brace patterns, globs, lists), checking that they exist before a run starts (and
splitting Parquet files into row groups, the unit a lane reads), and reading one unit as a stream of
WebDataset-shaped samples, with retries on transient errors and a policy for corrupt files, the same for
every format (`megascale.data.formats` reads each). Mixing, ordering and tokenization live elsewhere.

This module runs in lightweight reader processes started with "spawn": it must not import torch, not even
indirectly (`import webdataset` does; the tar format parses shards itself).
"""

from __future__ import annotations

import asyncio
import math
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, BinaryIO, Literal, cast

import braceexpand
from fsspec.asyn import AsyncFileSystem
from fsspec.core import url_to_fs
from fsspec.spec import AbstractFileSystem

from megascale.data.formats.base import FORMATS, ReadCursor, format_of, load, split_unit

__all__ = [
    "CorruptShardError",
    "DataSourceError",
    "ReadStats",
    "ShardNotFoundError",
    "ShardReadError",
    "Source",
    "expand_urls",
    "iter_samples",
    "iter_texts",
    "list_shards",
    "open_output",
]


class DataSourceError(RuntimeError):
    """A source or shard cannot be used; the message names it and says what to change."""


class ShardNotFoundError(DataSourceError, FileNotFoundError):
    """A shard named by a source does not exist."""


class ShardReadError(DataSourceError):
    """Reading a shard kept failing with transient errors after all retries."""


class CorruptShardError(DataSourceError):
    """A shard is not a valid tar file (corrupt, truncated, or holding duplicate members)."""


@dataclass(frozen=True)
class Source:
    """One dataset: WebDataset tar shards, Parquet files or JSONL(.zst) files.

    Attributes:
        urls: A local path, a brace pattern (``"s3://b/part-{0000..0099}.tar"``), any fsspec URL, a glob
            (``"/d/*.parquet"``), or a list of these.
        weight: Mixing weight relative to the other sources; must be > 0.
        storage_options: Passed to fsspec, e.g. ``{"endpoint_url": ..., "key": ..., "secret": ...}`` for S3
            (credentials otherwise come from the usual ``AWS_*`` variables).
        text_key: Where the text is: a tar member extension (default ``"txt"``), a Parquet column or a JSONL
            field (default ``"text"``).
        format: ``"tar"``, ``"parquet"`` or ``"jsonl"``; None: by each file's extension (``.parquet``,
            ``.jsonl``/``.json``/``.zst``/``.gz`` JSON Lines, anything else tar).
    """

    urls: str | list[str]
    weight: float = 1.0
    storage_options: dict[str, Any] | None = None
    text_key: str | None = None
    format: Literal["tar", "parquet", "jsonl"] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.urls, str) and not self.urls.strip():
            raise ValueError("Source.urls is empty: give a path, URL, brace pattern or glob of tar shards")
        if not isinstance(self.urls, str) and not all(isinstance(u, str) for u in self.urls):
            raise TypeError(f"Source.urls must be a string or a list of strings, got {self.urls!r}")
        if not (isinstance(self.weight, (int, float)) and math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(
                f"Source.weight must be a finite number > 0, got {self.weight!r} for {self.urls!r}"
            )
        if self.format is not None and self.format not in FORMATS:
            raise ValueError(
                f"Source.format must be one of {', '.join(FORMATS)} or None, got {self.format!r}"
            )
        if self.text_key is not None and not self.text_key:
            raise ValueError(
                "Source.text_key is empty: name the member extension, column or field of the text"
            )
        if self.text_key is not None and "." in self.text_key and self.format in (None, "tar"):
            first = self.urls if isinstance(self.urls, str) else (self.urls[0] if self.urls else "")
            if format_of(first, self.format) == "tar":
                raise ValueError(
                    f"Source.text_key must be a member extension such as 'txt', got {self.text_key!r}"
                )

    def text_key_of(self, url: str) -> str:
        """The text's key for one file or unit of this source (the format's default unless given)."""
        return self.text_key or load(format_of(url, self.format)).default_text_key


@dataclass
class ReadStats:
    """Counters a reader accumulates; pass one instance to several `iter_samples` calls to sum them."""

    shards_opened: int = 0
    samples: int = 0
    retries: int = 0
    corrupt_shards: int = 0
    skipped_samples: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict (for logging)."""
        return asdict(self)


# --------------------------------------------------------------------------------------------- naming


def _has_protocol(url: str) -> bool:
    return "://" in url or url.startswith("file:")


def _is_glob(url: str) -> bool:
    return any(c in url for c in "*?[")


def _local(url: str) -> str:
    if url.startswith("file://"):
        url = url[len("file://") :]
    return os.path.abspath(os.path.expanduser(url))


def _expand(urls: str | Sequence[str], storage_options: dict[str, Any], timeout: float | None) -> list[str]:
    if isinstance(urls, (str, os.PathLike)):
        urls = [os.fspath(urls)]
    out: list[str] = []
    for item in urls:
        for url in braceexpand.braceexpand(os.fspath(item)):
            local = not _has_protocol(url) or url.startswith("file:")
            if local:
                url = _local(url)
            if not _is_glob(url):
                out.append(url)
                continue
            fs, path = url_to_fs(url, **({} if local else storage_options))
            fs.invalidate_cache()  # a listing cached earlier in this process may predate new shards
            found = sorted(fs.glob(path, **_timeout_kw(fs, timeout)))
            out.extend(found if local else [fs.unstrip_protocol(p) for p in found])
    return out


def expand_urls(urls: str | Sequence[str], *, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Expand brace patterns and globs into a flat list of shard URLs.

    Brace patterns keep their order (``{0000..0099}`` keeps zero padding); globs are expanded in sorted
    order through fsspec (which lists the filesystem); relative local paths become absolute.

    Args:
        urls: A path, URL, brace pattern or glob, or a list of these.
        storage_options: fsspec options, needed only to expand globs on remote filesystems.

    Returns:
        The shard URLs; empty if a glob matched nothing.
    """
    return _expand(urls, storage_options or {}, None)


# --------------------------------------------------------------------------------------------- checking


def _timeout_kw(fs: AbstractFileSystem, timeout: float | None) -> dict[str, Any]:
    # Async filesystems (s3fs, gcsfs, http) accept `timeout=` on their sync wrappers and cancel the request.
    return {"timeout": max(timeout, 0.1)} if timeout is not None and isinstance(fs, AsyncFileSystem) else {}


def _fast_fail(url: str, options: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Storage options that make an S3 listing fail within `timeout` instead of retrying for minutes."""
    if not url.startswith(("s3://", "s3a://")):
        return options
    config = {
        "connect_timeout": min(5.0, timeout / 3),
        "read_timeout": min(15.0, timeout / 2),
        "retries": {"total_max_attempts": 2},
    }
    return {**options, "config_kwargs": {**config, **options.get("config_kwargs", {})}}


def _endpoint(options: dict[str, Any] | None) -> str:
    options = options or {}
    return str(
        options.get("endpoint_url")
        or options.get("client_kwargs", {}).get("endpoint_url")
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
        or "the default AWS endpoint"
    )


def _check_bucket(
    fs: AbstractFileSystem, url: str, where: str, options: dict[str, Any], timeout: float
) -> None:
    """Raise DataSourceError if `url` is on an object store and its bucket does not exist."""
    if not url.startswith(("s3://", "s3a://", "gs://", "gcs://", "az://", "abfs://")):
        return
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    if not fs.exists(bucket, **_timeout_kw(fs, timeout)):
        raise DataSourceError(
            f"{where}: bucket {bucket!r} does not exist at {_endpoint(options)}; check the bucket name and "
            "endpoint_url"
        )


def _units(source: Source, urls: list[str], options: dict[str, Any]) -> list[str]:
    """The units the order deals out: each file, or each row group of a Parquet file (``#row_group=<k>``)."""
    kinds = {format_of(url, source.format) for url in urls}
    if len(kinds) > 1:
        raise DataSourceError(
            f"source {source.urls!r} mixes formats ({', '.join(sorted(kinds))}): give each format a source of its "
            "own (with weights), or set format="
        )
    units: list[str] = []
    for url in urls:
        if format_of(url, source.format) != "parquet":
            units.append(url)
            continue
        from megascale.data.formats import parquet

        fs, path = _fs(url, options)
        try:
            groups = parquet.row_groups(fs, path, url, source.text_key_of(url))
        except ValueError as e:
            raise DataSourceError(str(e)) from e
        units += [f"{url}#row_group={k}" for k in range(groups)]
    return units


def _fs(url: str, storage_options: dict[str, Any] | None) -> tuple[AbstractFileSystem, str]:
    local = not _has_protocol(url) or url.startswith("file:")
    return url_to_fs(_local(url) if local else url, **({} if local else storage_options or {}))


def list_shards(source: Source, *, timeout: float = 30.0) -> list[str]:
    """Expand a source's URLs and check that every file exists, with one listing per directory/prefix; a
    Parquet file becomes one unit per row group (``<url>#row_group=<k>``, its footer read to count them).

    Args:
        source: The dataset.
        timeout: Seconds allowed per filesystem request; an unreachable endpoint fails within about this.

    Returns:
        The shard URLs, in the source's order.

    Raises:
        ShardNotFoundError: Some shards do not exist (the first few are named).
        DataSourceError: The source matched no shards, or the filesystem could not be reached or listed
            (bad endpoint, bucket, or credentials).
    """
    options = source.storage_options or {}
    first = source.urls if isinstance(source.urls, str) else (source.urls[0] if source.urls else "")
    options = _fast_fail(first, options, timeout)
    named = (
        source.urls if isinstance(source.urls, str) or len(source.urls) <= 3 else [*source.urls[:3], "..."]
    )
    where = f"source {named!r}"
    remote = _has_protocol(first) and not first.startswith("file:")
    if remote:
        where += f" (endpoint {_endpoint(options)})"
    try:
        urls = _expand(source.urls, options, timeout)
        if not urls and remote:
            _check_bucket(url_to_fs(first, **options)[0], first, where, options, timeout)
        if not urls:
            raise DataSourceError(f"{where} matched no shards: check the path, brace pattern or glob")
        groups: dict[tuple[int, str], list[tuple[str, str]]] = {}
        filesystems: dict[int, AbstractFileSystem] = {}
        for url in urls:
            fs, path = url_to_fs(url, **({} if not _has_protocol(url) else options))
            filesystems[id(fs)] = fs
            groups.setdefault((id(fs), fs._parent(path)), []).append((url, fs._strip_protocol(path)))
        missing: list[str] = []
        for (fs_id, parent), items in groups.items():
            fs = filesystems[fs_id]
            protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
            if protocols & {"http", "https"}:  # no listings over plain HTTP
                missing += [u for u, p in items if not fs.exists(p, **_timeout_kw(fs, timeout))]
                continue
            try:
                listing = fs.ls(parent, detail=False, refresh=True, **_timeout_kw(fs, timeout))
            except FileNotFoundError:
                listing = []
            names = {fs._strip_protocol(n).rstrip("/") for n in listing}
            missing += [u for u, p in items if p.rstrip("/") not in names]
        if missing:
            if _has_protocol(missing[0]):
                _check_bucket(url_to_fs(missing[0], **options)[0], missing[0], where, options, timeout)
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ShardNotFoundError(
                f"{where}: {len(missing)} of {len(urls)} shards do not exist: {shown}; check the pattern's "
                "range and that the shards were written"
            )
        return _units(source, urls, options)
    except DataSourceError:
        raise
    except PermissionError as e:
        raise DataSourceError(
            f"{where}: access denied ({e}); check the credentials (storage_options key/secret or the AWS_* "
            "variables) and the bucket's permissions"
        ) from e
    except Exception as e:  # endpoint down, DNS, timeouts, botocore errors: never a bare traceback
        raise DataSourceError(
            f"{where} could not be listed within {timeout:g} s: {type(e).__name__}: {e}. Check that "
            "endpoint_url is right and reachable, the credentials, and the bucket name"
        ) from e


# --------------------------------------------------------------------------------------------- reading

_NOT_TRANSIENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
_TRANSIENT_MODULES = ("botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "http", "s3fs", "gcsfs")


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, _NOT_TRANSIENT):
        return False
    if isinstance(exc, (OSError, ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    return any(cls.__module__.split(".")[0] in _TRANSIENT_MODULES for cls in type(exc).__mro__)


def iter_samples(
    url: str,
    *,
    storage_options: dict[str, Any] | None = None,
    retries: int = 3,
    backoff: float = 0.5,
    on_corrupt: Literal["warn", "raise"] = "warn",
    stats: ReadStats | None = None,
    format: str | None = None,
    text_key: str | None = None,
) -> Iterator[dict[str, Any]]:
    """Stream the samples of one unit (a tar shard, a JSONL file, a Parquet row group), in file order.

    Tar members are grouped into samples as WebDataset does: the key is the member path up to the first dot
    of its file name, the extension (lower-cased) the rest; ``__key__`` and ``__url__`` are added. A JSONL
    line or a Parquet row is one sample whose ``text_key`` holds the text as UTF-8 bytes.

    Transient errors (connection, timeout, S3 client errors) while opening or reading are retried: wait
    ``backoff * 2**(n-1)`` before the n-th retry, reopen, resume after the last sample yielded (by byte
    offset for plain tar, else by re-reading and skipping), so the caller never sees a repeated or missing
    sample. The retry count starts afresh once a retry has made progress.

    A corrupt or truncated shard ends the shard: the samples read before the damage have been yielded, the
    one being read when it was found is dropped (it may be incomplete) and counted in ``skipped_samples``.

    Args:
        url: The shard (local path or fsspec URL).
        storage_options: fsspec options (S3: ``endpoint_url``, ``key``, ``secret``, ``config_kwargs``...).
        retries: Retries after a transient error before giving up.
        backoff: Seconds before the first retry; doubles on each further retry.
        on_corrupt: ``"warn"`` to warn and stop this shard, ``"raise"`` to raise `CorruptShardError`.
        stats: Counters to update.
        format: ``"tar"``, ``"parquet"`` or ``"jsonl"``; None: by the file's extension.
        text_key: the Parquet column / JSONL field of the text (default ``"text"``); tar samples hold all
            their members whatever it is.

    Yields:
        ``{"__key__": str, "__url__": url, "<ext>": bytes, ...}`` per sample.

    Raises:
        ShardNotFoundError: The shard does not exist (not retried).
        ShardReadError: Transient errors persisted through all retries.
        CorruptShardError: The shard is damaged and ``on_corrupt="raise"``.
    """
    if on_corrupt not in ("warn", "raise"):
        raise ValueError(f"on_corrupt must be 'warn' or 'raise', got {on_corrupt!r}")
    stats = stats if stats is not None else ReadStats()
    kind = load(format_of(url, format))
    key = text_key or kind.default_text_key
    fs, path = _fs(split_unit(url)[0], storage_options)
    cur = ReadCursor()
    failures = 0
    opened = False
    while True:
        progress_mark = cur.done
        try:
            for sample in kind.read(fs, path, url, cur, key):
                if not opened:
                    opened, stats.shards_opened = True, stats.shards_opened + 1
                cur.done += 1
                stats.samples += 1
                yield sample
            if not opened:  # an archive without samples
                stats.shards_opened += 1
            return
        except FileNotFoundError as e:
            raise ShardNotFoundError(f"shard {url} does not exist ({e}); check the source's URLs") from e
        except PermissionError as e:
            raise DataSourceError(
                f"shard {url}: access denied ({e}); check the credentials and permissions"
            ) from e
        except kind.corrupt as e:
            stats.corrupt_shards += 1
            stats.skipped_samples += int(cur.pending)
            message = f"shard {url} is corrupt or truncated after {cur.done} samples: {e}"
            if on_corrupt == "raise":
                raise CorruptShardError(f"{message}; rewrite or remove the shard") from e
            warnings.warn(f"{message}; skipping the rest of the shard", RuntimeWarning, stacklevel=2)
            return
        except Exception as e:
            if not _is_transient(e):
                raise
            failures = 1 if cur.done > progress_mark else failures + 1
            if failures > retries:
                raise ShardReadError(
                    f"could not read shard {url} after {failures} attempts (at sample {cur.done}): "
                    f"{type(e).__name__}: {e}; check the endpoint and network, or raise `retries`"
                ) from e
            stats.retries += 1
            time.sleep(backoff * 2 ** (failures - 1))


def iter_texts(source: Source, unit: str, **kwargs: Any) -> Iterator[bytes]:
    """The UTF-8 text of each document of one unit of ``source`` (samples without it skipped); ``kwargs``
    go to `iter_samples` (retries, on_corrupt, stats)."""
    key = source.text_key_of(unit)
    for sample in iter_samples(
        unit, storage_options=source.storage_options, format=source.format, text_key=key, **kwargs
    ):
        raw = sample.get(key)
        if raw is not None:
            yield raw


# --------------------------------------------------------------------------------------------- writing


def open_output(url: str, storage_options: dict[str, Any] | None = None) -> BinaryIO:
    """Open a file for writing through fsspec; parent directories of local paths are created.

    Args:
        url: Local path or fsspec URL.
        storage_options: fsspec options for remote URLs.

    Returns:
        A binary file object; close it (or use ``with``) to finish the upload.
    """
    local = not _has_protocol(url) or url.startswith("file:")
    if local:
        url = _local(url)
        os.makedirs(os.path.dirname(url), exist_ok=True)
    fs, path = url_to_fs(url, **({} if local else storage_options or {}))
    return cast(BinaryIO, fs.open(path, "wb"))
