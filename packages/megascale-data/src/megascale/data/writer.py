"""Writing WebDataset tar shards of text documents (the `megascale-data shard` command and the embedded
dataset use it)."""

from __future__ import annotations

import io
import tarfile
from typing import Any, BinaryIO

from megascale.data.sources import open_output

__all__ = ["ShardWriter"]


class ShardWriter:
    """Writes text documents into PREFIX-%06d.tar, starting a new shard at `max_docs` documents or `max_bytes`.

    Each document becomes one sample ``{"__key__": f"{n:09d}", "txt": <utf-8 bytes>}``; `pattern` is the
    brace pattern naming every shard written, as `Source` reads it.
    """

    def __init__(self, output: str, prefix: str, max_docs: int, max_bytes: int, options: dict[str, Any]):
        self.output, self.prefix, self.options = output.rstrip("/"), prefix, options
        self.max_docs, self.max_bytes = max_docs, max_bytes
        self.shards = self.docs = self.bytes = 0
        self._file: BinaryIO | None = None
        self._tar: tarfile.TarFile | None = None
        self._shard_docs = self._shard_bytes = 0

    def shard_url(self, index: int) -> str:
        return f"{self.output}/{self.prefix}-{index:06d}.tar"

    def write(self, text: str) -> None:
        data = text.encode("utf-8")
        full = self._shard_docs >= self.max_docs or self._shard_bytes + len(data) > self.max_bytes
        if self._tar is None or (self._shard_docs and full):
            self._roll()
        info = tarfile.TarInfo(f"{self.docs:09d}.txt")
        # A fixed mtime: identical inputs make identical shards.
        info.size, info.mode, info.mtime = len(data), 0o644, 0
        assert self._tar is not None
        self._tar.addfile(info, io.BytesIO(data))
        self.docs, self.bytes = self.docs + 1, self.bytes + len(data)
        self._shard_docs, self._shard_bytes = self._shard_docs + 1, self._shard_bytes + len(data)

    def _roll(self) -> None:
        self.close()
        self._file = open_output(self.shard_url(self.shards), self.options)
        self._tar = tarfile.open(fileobj=self._file, mode="w|")  # noqa: SIM115 - closed by close()
        self.shards += 1
        self._shard_docs = self._shard_bytes = 0

    def close(self) -> None:
        if self._tar is not None:
            self._tar.close()
        if self._file is not None:
            self._file.close()
        self._tar = self._file = None

    def pattern(self) -> str:
        if self.shards == 1:
            return self.shard_url(0)
        return f"{self.output}/{self.prefix}-{{{0:06d}..{self.shards - 1:06d}}}.tar"
