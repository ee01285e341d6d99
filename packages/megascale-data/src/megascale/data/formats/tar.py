"""WebDataset tar shards: members grouped into samples exactly as WebDataset's `tar_file_iterator` +
`group_by_keys` do, parsed with the standard library's `tarfile` in streaming mode (`import webdataset` imports
torch, which reader processes must not). The resumable unit is the file; a retry of an uncompressed, seekable
shard resumes at the byte offset of the first sample not yet yielded.
"""

from __future__ import annotations

import re
import tarfile
import zlib
from collections.abc import Iterator
from typing import Any, BinaryIO, cast

from fsspec.spec import AbstractFileSystem

from megascale.data.formats.base import Format, ReadCursor, register

__all__ = ["CORRUPT", "EXTENSIONS", "FORMAT", "read"]

EXTENSIONS = (".tar", ".tar.gz", ".tgz")
DEFAULT_TEXT_KEY = "txt"

_META = re.compile(r"__[^/]*__($|/)")  # WebDataset skips members like __index__
_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # WebDataset's base_plus_ext


class _DuplicateMemberError(ValueError):
    """Two members of one sample have the same extension (WebDataset refuses such a shard too)."""


CORRUPT = (tarfile.TarError, EOFError, zlib.error, _DuplicateMemberError)
# Not in tarfile's __all__ (nor its stubs), but stable since Python 3.2.
_EOFHeaderError: type[Exception] = tarfile.EOFHeaderError  # type: ignore[attr-defined]
_EmptyHeaderError: type[Exception] = tarfile.EmptyHeaderError  # type: ignore[attr-defined]


class _StrictTarInfo(tarfile.TarInfo):
    """Header parsing that reports damage: `tarfile` silently ends the archive at a bad or missing header
    after the first one, which would turn a corrupt or truncated shard into a short one."""

    @classmethod
    def fromtarfile(cls, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:  # type: ignore[override]
        try:
            return super().fromtarfile(tarfile_)
        except _EOFHeaderError:  # a zero block: the regular end of the archive
            raise
        except _EmptyHeaderError:
            raise tarfile.ReadError(
                f"file ends at byte {tarfile_.offset} without the end-of-archive marker (truncated)"
            ) from None
        except tarfile.HeaderError as e:
            raise tarfile.ReadError(f"bad tar header at byte {tarfile_.offset}: {e}") from None


def _open_tar(fs: AbstractFileSystem, path: str, offset: int) -> tuple[Any, tarfile.TarFile]:
    f = fs.open(path, "rb")
    try:
        if offset:
            f.seek(offset)
        # "r|": a forward-only stream; never the whole shard in memory. From an offset the stream is plain.
        return f, tarfile.open(fileobj=f, mode="r|" if offset else "r|*", tarinfo=_StrictTarInfo)
    except BaseException:
        f.close()
        raise


def read(
    fs: AbstractFileSystem, path: str, url: str, cur: ReadCursor, text_key: str
) -> Iterator[dict[str, Any]]:
    """The WebDataset samples of a tar shard from ``cur`` on (``text_key`` is a member extension of each)."""
    base = cur.offset if cur.seekable else 0
    skip = 0 if cur.seekable else cur.done
    cur.pending = False
    f, tar = _open_tar(fs, path, base)
    with f, tar:
        cur.seekable = getattr(tar.fileobj, "comptype", None) == "tar" and f.seekable()
        sample: dict[str, Any] | None = None
        for info in tar:
            tar.members = []  # type: ignore[attr-defined]  # streaming mode would keep every header
            if not info.isreg() or _META.match(info.name):
                continue
            match = _KEY_EXT.match(info.name)
            if match is None:
                continue
            key, ext = match.group(1), match.group(2).lower()
            if sample is None or key != sample["__key__"]:
                if sample is not None:
                    if skip:
                        skip -= 1
                    else:
                        cur.offset = base + info.offset  # where the sample after this one starts
                        yield sample
                sample, cur.pending = {"__key__": key, "__url__": url}, True
            data = cast(BinaryIO, tar.extractfile(info)).read()  # after yielding the complete sample
            if ext in sample:
                raise _DuplicateMemberError(f"duplicate member {info.name!r} in sample {key!r}")
            sample[ext] = data
        if sample is not None and not skip:
            yield sample


FORMAT = register(Format("tar", read, lambda: CORRUPT, DEFAULT_TEXT_KEY))
