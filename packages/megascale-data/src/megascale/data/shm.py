"""A shared-memory ring: one writer (the node's reader process), several readers (the node's ranks).

One file in /dev/shm, mapped by every process of the node. No locks: every field has exactly one writer,
and the reader checks what it copied against the writer's checksum, so the protocol holds on CPUs that
reorder stores too.

    header      magic, state, writer pid, creator pid, sizes, info (JSON the writer publishes once),
                error (text the writer publishes before it gives up)
    consumers   per consumer: registered, data-parallel rank, pid, next sequence number it will read
    slots       per slot: sequence number, payload bytes, meta bytes, checksum; then payload | meta

Slot `seq % slots` holds sequence number `seq`; the writer reuses it once every consumer has read past it.

Segments never outlive the run: the file is unlinked as soon as every consumer has mapped it (the memory then
goes away with the last process, however it ends, SIGKILL included); until then `cleanup_stale` removes the
files of runs whose creator is dead, and the creator unlinks at exit.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import struct
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

__all__ = ["RingClosedError", "ShmRing", "cleanup_stale", "pid_alive", "shm_directory"]

PREFIX = "megascale-data"
_MAGIC = 0x4D534452  # "MSDR"
_HEADER = struct.Struct("<IIqqqqqqqq")  # magic, state, writer_pid, creator_pid, consumers, slots, slot_bytes,
#                                          meta_bytes, info_len, error_len
_HEADER_SPACE = 4096
_INFO_BYTES = 64 * 1024
_ERROR_BYTES = 16 * 1024
_CONSUMER = 4  # int64 fields: registered, dp_rank, pid, next_seq
_SLOT_HEADER = 4  # int64 fields: seq, payload_len, meta_len, checksum
INIT, READY, ERROR, CLOSED = 0, 1, 2, 3


class RingClosedError(RuntimeError):
    """The other side ended: the writer published an error, died, or closed the ring."""


def shm_directory() -> Path:
    """/dev/shm where it exists (Linux), else the temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ring_path(run_id: str, node: int, creator_pid: int, directory: Path | None = None) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.]", "_", run_id)
    return (directory or shm_directory()) / f"{PREFIX}-{safe}-node{node}-{creator_pid}"


def find_ring(run_id: str, node: int, directory: Path | None = None) -> Path | None:
    """The ring file of a live creator for this run and node, if one exists now."""
    base = ring_path(run_id, node, 0, directory).name.rsplit("-", 1)[0] + "-"
    for path in sorted((directory or shm_directory()).glob(base + "*")):
        pid = path.name.rsplit("-", 1)[1]
        if pid.isdigit() and pid_alive(int(pid)):  # (".spec" files fail isdigit)
            return path
    return None


def cleanup_stale(directory: Path | None = None) -> list[Path]:
    """Remove ring files whose creator process is dead (left by a crashed run); returns what was removed."""
    removed = []
    for path in (directory or shm_directory()).glob(f"{PREFIX}-*"):
        pid = path.name.rsplit("-", 1)[-1].removesuffix(".spec").removesuffix(".tmp")
        if pid.isdigit() and not pid_alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
    return removed


def _wait(predicate: Callable[[], bool], timeout: float, check: Callable[[], None], what: str) -> None:
    """Poll ``predicate`` with a growing sleep; ``check`` raises if waiting is pointless."""
    deadline, sleep = time.monotonic() + timeout, 2e-5
    while not predicate():
        try:
            check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout:.0f} s for {what}")
        except Exception:
            # it may have come true after we looked: a batch published before the ring closed (or the
            # writer left) is still there to read, and a rank must not end one batch short (CI, 2026-12-07)
            if predicate():
                return
            raise
        time.sleep(sleep)
        sleep = min(sleep * 2, 2e-3)


class ShmRing:
    """The mapped ring. Create with `create` (the node's first rank) or `attach` (everyone else)."""

    def __init__(self, path: Path, mm: mmap.mmap) -> None:
        self.path, self._mm = path, mm
        (magic, _, _, _, consumers, slots, slot_bytes, meta_bytes, _, _) = _HEADER.unpack_from(mm, 0)
        if magic != _MAGIC:
            raise RingClosedError(f"{path} is not a megascale-data ring")
        self.consumers, self.slots, self.slot_bytes, self.meta_bytes = (
            consumers,
            slots,
            slot_bytes,
            meta_bytes,
        )
        self._ints = np.frombuffer(mm, dtype=np.int64)  # header fields as int64 where aligned
        base = (_HEADER_SPACE + _INFO_BYTES + _ERROR_BYTES) // 8
        self._consumer = self._ints[base : base + consumers * _CONSUMER].reshape(consumers, _CONSUMER)
        base += consumers * _CONSUMER
        self._slot_header = self._ints[base : base + slots * _SLOT_HEADER].reshape(slots, _SLOT_HEADER)
        self._data_start = (base + slots * _SLOT_HEADER) * 8
        self._slot_span = slot_bytes + meta_bytes

    # --- creation and attachment ---------------------------------------------------------------------

    @staticmethod
    def size_for(consumers: int, slots: int, slot_bytes: int, meta_bytes: int) -> int:
        fixed = (
            _HEADER_SPACE + _INFO_BYTES + _ERROR_BYTES + 8 * (consumers * _CONSUMER + slots * _SLOT_HEADER)
        )
        return fixed + slots * (slot_bytes + meta_bytes)

    @classmethod
    def create(
        cls, path: Path, *, consumers: int, slots: int, slot_bytes: int, meta_bytes: int = 256 * 1024
    ) -> ShmRing:
        """Create the ring file (exclusively: an existing file is an error) and map it."""
        size = cls.size_for(consumers, slots, slot_bytes, meta_bytes)
        staging = path.with_name(path.name + ".tmp")  # renamed when complete: nobody maps a half-made ring
        fd = os.open(staging, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        _HEADER.pack_into(mm, 0, _MAGIC, INIT, 0, os.getpid(), consumers, slots, slot_bytes, meta_bytes, 0, 0)
        ring = cls(path, mm)
        ring._slot_header[:, 0] = -1
        if path.exists():
            staging.unlink()
            raise FileExistsError(f"{path} exists: another reader of this run and node is alive")
        os.rename(staging, path)
        return ring

    @classmethod
    def attach(cls, path: Path) -> ShmRing:
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(path, mm)

    def _field(self, index: int) -> int:
        return int(_HEADER.unpack_from(self._mm, 0)[index])

    def _set_field(self, index: int, value: int) -> None:
        offset = struct.calcsize("<II") + 8 * (index - 2) if index >= 2 else 4 * index
        struct.pack_into("<q" if index >= 2 else "<I", self._mm, offset, value)

    @property
    def state(self) -> int:
        return self._field(1)

    @property
    def writer_pid(self) -> int:
        return self._field(2)

    @property
    def creator_pid(self) -> int:
        return self._field(3)

    def unlink(self) -> None:
        """Remove the file name; mappings stay valid until every process unmaps."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # a view is still alive; the mapping goes with the process
            self._mm.close()

    # --- the writer's side ---------------------------------------------------------------------------

    def publish_info(self, info: dict) -> None:
        raw = json.dumps(info).encode()
        if len(raw) > _INFO_BYTES:
            raise ValueError(f"ring info of {len(raw)} bytes exceeds {_INFO_BYTES}")
        self._mm[_HEADER_SPACE : _HEADER_SPACE + len(raw)] = raw
        self._set_field(8, len(raw))
        self._set_field(2, os.getpid())
        self._set_field(1, READY)

    def publish_error(self, message: str) -> None:
        raw = message.encode()[-_ERROR_BYTES:]
        start = _HEADER_SPACE + _INFO_BYTES
        self._mm[start : start + len(raw)] = raw
        self._set_field(9, len(raw))
        self._set_field(1, ERROR)

    def mark_closed(self) -> None:
        if self.state != ERROR:
            self._set_field(1, CLOSED)

    def registered(self) -> list[tuple[int, int, int]]:
        """(consumer, dp rank, pid) of every consumer registered so far."""
        return [(c, int(row[1]), int(row[2])) for c, row in enumerate(self._consumer) if row[0]]

    def min_next(self) -> int:
        return int(self._consumer[:, 3].min())

    def write(
        self, seq: int, payload: np.ndarray, meta: bytes, *, timeout: float, check: Callable[[], None]
    ) -> None:
        """Publish sequence number ``seq`` once every consumer has read ``seq - slots``."""
        raw = np.ascontiguousarray(payload).data.cast("B")
        if len(raw) > self.slot_bytes or len(meta) > self.meta_bytes:
            raise ValueError(
                f"slot overflow: {len(raw)} > {self.slot_bytes} or meta {len(meta)} > {self.meta_bytes}"
            )
        _wait(
            lambda: self.min_next() > seq - self.slots,
            timeout,
            check,
            f"the ranks to read batch {seq - self.slots}",
        )
        slot = seq % self.slots
        start = self._data_start + slot * self._slot_span
        self._mm[start : start + len(raw)] = raw
        self._mm[start + self.slot_bytes : start + self.slot_bytes + len(meta)] = meta
        checksum = zlib.adler32(meta, zlib.adler32(raw))
        header = self._slot_header[slot]
        header[1], header[2], header[3] = len(raw), len(meta), checksum
        header[0] = seq  # last: the slot is now readable

    # --- a consumer's side ---------------------------------------------------------------------------

    def info(self) -> dict:
        length = self._field(8)
        return json.loads(bytes(self._mm[_HEADER_SPACE : _HEADER_SPACE + length]))

    def error(self) -> str:
        length, start = self._field(9), _HEADER_SPACE + _INFO_BYTES
        return bytes(self._mm[start : start + length]).decode(errors="replace")

    def register(self, consumer: int, dp_rank: int) -> None:
        row = self._consumer[consumer]
        if row[0]:
            raise RuntimeError(
                f"consumer slot {consumer} of {self.path} is taken (two ranks with one local rank?)"
            )
        row[1], row[2], row[3] = dp_rank, os.getpid(), 0
        row[0] = 1

    def set_next(self, consumer: int, seq: int) -> None:
        self._consumer[consumer, 3] = seq

    def read(
        self, consumer: int, seq: int, *, timeout: float, check: Callable[[], None]
    ) -> tuple[bytes, bytes]:
        """Copies of (payload, meta) of sequence number ``seq``; marks it read by ``consumer``."""
        slot = seq % self.slots
        header = self._slot_header[slot]
        while True:
            _wait(lambda: int(header[0]) == seq, timeout, check, f"batch {seq} from the data reader")
            start = self._data_start + slot * self._slot_span
            n, m, checksum = int(header[1]), int(header[2]), int(header[3])
            payload = bytes(self._mm[start : start + n])
            meta = bytes(self._mm[start + self.slot_bytes : start + self.slot_bytes + m])
            if zlib.adler32(meta, zlib.adler32(payload)) == checksum:
                break  # else: the stores were not all visible yet; read again
        self._consumer[consumer, 3] = seq + 1
        return payload, meta
