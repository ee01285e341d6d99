"""The commit record of a checkpoint directory: ``manifest.json``, its checksums, and how it is written.

Scope: everything that decides whether a ``step-NNNNNNNNN/`` directory is a *committed*, *intact*
checkpoint, plus the guarded reading of DCP's pickled ``.metadata`` file. Nothing here knows about
process groups; the checkpointer decides which rank hashes which file and who writes the manifest.

Design choices:

- A directory is committed when ``manifest.json`` exists; it is written last, after every rank's files.
  On a local filesystem it is written under a temporary name and renamed (atomic on POSIX); on object
  stores (S3) the object appearing *is* the commit, since a PUT is all-or-nothing.
- The checksum is SHA-256 over each file's bytes, with the file size, for every file in the directory.
  It detects torn writes, truncation and bit rot. It is *not* an authentication mechanism: whoever can
  write the files can rewrite the manifest too. That is why the loading path never relies on it alone
  for safety (see `SafeFsspecReader`).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

MANIFEST_NAME = "manifest.json"
EXTRA_NAME = "extra.json"
FORMAT_NAME = "megascale-ft-checkpoint"
FORMAT_VERSION = 1
CHECKSUM = "sha256"
_CHUNK = 8 << 20


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial, corrupt, unsafe, or could not be written."""


@dataclass
class Manifest:
    """What ``manifest.json`` records about one committed checkpoint directory.

    Attributes:
        step: the training step the checkpoint holds.
        world_size: how many ranks wrote it.
        files: relative path -> ``{"size": int, "sha256": hex}`` for every file but the manifest.
        format_version: version of this layout; readers refuse versions they do not know.
        checksum: the checksum algorithm (always ``"sha256"`` in format version 1).
        created_unix: wall-clock time of the commit.
        torch_version: the torch that wrote the DCP files (informational).
    """

    step: int
    world_size: int
    files: dict[str, dict[str, Any]]
    format_version: int = FORMAT_VERSION
    checksum: str = CHECKSUM
    created_unix: float = field(default_factory=time.time)
    torch_version: str = torch.__version__

    def to_json(self) -> str:
        """The manifest as the JSON text written to ``manifest.json``."""
        return json.dumps(
            {
                "format": FORMAT_NAME,
                "format_version": self.format_version,
                "step": self.step,
                "world_size": self.world_size,
                "checksum": self.checksum,
                "files": self.files,
                "created_unix": self.created_unix,
                "torch_version": self.torch_version,
            },
            indent=1,
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str, where: str) -> Manifest:
        """Parse and validate manifest text; ``where`` names the file in errors."""
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT_NAME:
                raise ValueError(f"format is {raw.get('format')!r}, expected {FORMAT_NAME!r}")
            if raw.get("format_version") != FORMAT_VERSION:
                raise ValueError(
                    f"format_version {raw.get('format_version')!r} is not supported (this reader knows "
                    f"{FORMAT_VERSION}); upgrade megascale-ft"
                )
            if raw.get("checksum") != CHECKSUM:
                raise ValueError(f"checksum {raw.get('checksum')!r} is not supported")
            files = raw["files"]
            if not isinstance(files, dict) or not all(
                isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get(CHECKSUM), str)
                for v in files.values()
            ):
                raise ValueError("'files' must map names to {size, sha256}")
            return cls(
                step=int(raw["step"]),
                world_size=int(raw["world_size"]),
                files=files,
                created_unix=float(raw.get("created_unix", 0.0)),
                torch_version=str(raw.get("torch_version", "")),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(
                f"{where} is not a valid manifest ({e}); delete that checkpoint directory"
            ) from e


def hash_file(fs: AbstractFileSystem, path: str) -> dict[str, Any]:
    """Size and SHA-256 of one file, read in chunks."""
    h = hashlib.sha256()
    size = 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, CHECKSUM: h.hexdigest()}


def list_files(fs: AbstractFileSystem, directory: str) -> list[str]:
    """Relative paths of every file under ``directory`` except the manifest and its temporary, sorted."""
    fs.invalidate_cache(directory)  # s3fs caches listings; a stale one would miss the files just written
    prefix = directory.rstrip("/") + "/"
    names = [p[len(prefix) :] for p in fs.find(directory) if p.startswith(prefix)]
    return sorted(n for n in names if not n.startswith(MANIFEST_NAME))


def write_manifest(fs: AbstractFileSystem, directory: str, manifest: Manifest) -> None:
    """Write ``manifest.json`` into ``directory``: the commit point of the checkpoint.

    Local filesystems: written to a temporary name, flushed to disk, then renamed over the final name
    (atomic on POSIX). Other filesystems (S3): one PUT of the whole object, which is all-or-nothing.
    """
    final = f"{directory}/{MANIFEST_NAME}"
    data = manifest.to_json().encode()
    if isinstance(fs, LocalFileSystem):
        tmp = f"{final}.tmp"
        with open(tmp, "wb") as f:  # fsspec paths of a LocalFileSystem are plain OS paths
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        fs.mv(tmp, final)
    else:
        fs.pipe_file(final, data)


def read_manifest(fs: AbstractFileSystem, directory: str, where: str) -> Manifest | None:
    """The manifest of ``directory``, or None when it has none (a partial checkpoint)."""
    path = f"{directory}/{MANIFEST_NAME}"
    try:
        text = fs.cat_file(path).decode()
    except FileNotFoundError:
        return None
    return Manifest.from_json(text, where)


def verify_files(
    fs: AbstractFileSystem,
    directory: str,
    manifest: Manifest,
    on_read: Callable[[int], None] | None = None,
    *,
    share: tuple[int, int] = (0, 1),
    threads: int = 4,
) -> str | None:
    """Check the files the manifest lists; return None when all match, else why not (the first mismatch in
    name order).

    ``share=(i, n)``: check only every n-th file from the i-th (in name order), so n ranks verify a
    checkpoint together, each reading 1/n of it, instead of one rank reading all of it; ``threads`` files are
    hashed at once (hashlib releases the GIL, and remote reads overlap). ``on_read``, when given, is called
    with the size of each file read (to account for storage reads).
    """
    index, count = share
    names = sorted(manifest.files)[index::count]

    def check(name: str) -> str | None:
        expected = manifest.files[name]
        try:
            got = hash_file(fs, f"{directory}/{name}")
        except FileNotFoundError:
            return f"file {name} listed in the manifest is missing"
        if on_read is not None:
            on_read(got["size"])
        if got["size"] != expected["size"]:
            return f"file {name} has {got['size']} bytes, the manifest says {expected['size']}"
        if got[CHECKSUM] != expected[CHECKSUM]:
            return f"file {name} does not match its {CHECKSUM} in the manifest"
        return None

    if threads <= 1 or len(names) <= 1:
        reasons = [check(name) for name in names]
    else:
        with ThreadPoolExecutor(min(threads, len(names)), thread_name_prefix="megascale-ft-verify") as pool:
            reasons = list(pool.map(check, names))
    return next((r for r in reasons if r is not None), None)


# --- Guarded reading of DCP's `.metadata` ------------------------------------------------------------
#
# torch 2.13's FileSystemReader.read_metadata does `pickle.load` on `.metadata`: a crafted file would run
# code on load. The manifest checksum catches corruption but not a deliberate rewrite, so the reader below
# replaces that call with an Unpickler that resolves only the classes DCP's metadata is made of and refuses
# everything else *before* anything is constructed or called.

_ALLOWED_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "StorageMeta",
            "MetadataIndex",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "TensorProperties",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath"}),  # StorageMeta.checkpoint_id of DCP's plain writer
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"refusing to load {module}.{name}: a DCP .metadata file holds only checkpoint metadata classes"
        )


def load_metadata_safely(data: bytes) -> Metadata:
    """Unpickle DCP metadata bytes, resolving only DCP's own metadata classes, torch.Size and dtypes."""
    metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f".metadata holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class SafeFsspecReader(FsspecReader):
    """DCP's fsspec reader with `.metadata` read by `load_metadata_safely` instead of `pickle.load`.

    Tensor data is read by DCP with ``torch.load(weights_only=True)`` already; non-tensor (``BYTE_IO``)
    items are refused by the checkpointer's load planner, so no path here unpickles arbitrary objects.

    It also counts what it reads, for restore statistics: ``metadata_bytes_read`` (``.metadata``) and
    ``data_bytes_read`` (the stored tensor items DCP read, at their stored size).
    """

    def __init__(self, path: str, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.metadata_bytes_read = 0
        self.data_bytes_read = 0

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read the plan's items (DCP's reader), then count them: it reads each item's stored bytes."""
        done = super().read_data(plan, planner)
        self.data_bytes_read += sum(self.storage_data[item.storage_index].length for item in plan.items)
        return done

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Read ``.metadata`` with the restricted unpickler (same contract as DCP's reader)."""
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            data = f.read()
        self.metadata_bytes_read += len(data)
        try:
            metadata = load_metadata_safely(data)
        except Exception as e:
            raise CheckpointError(
                f"{path} is not a plain DCP metadata file ({e}); the checkpoint was tampered with or written "
                "by something else: do not load it, delete it"
            ) from e
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata
