"""Hugging Face model directories on disk: ``config.json`` and safetensors, one file or sharded by an index.

Layout (what transformers' ``save_pretrained`` writes and ``from_pretrained`` reads):
    config.json
    model.safetensors                                  everything in one file, or
    model-00001-of-0000N.safetensors ...               shards, with
    model.safetensors.index.json                       {"metadata": {"total_size": bytes},
                                                        "weight_map": {tensor name: shard file}}

Reading is lazy (``safetensors.safe_open`` memory-maps a file and reads a tensor, or a slice of one, when
asked), so ``HFCheckpoint`` answers names and shapes from the headers alone and a caller can read only the
tensors or rows it needs. Shards are written with the ``{"format": "pt"}`` metadata transformers checks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any

import torch

from megascale.core import _optional

__all__ = [
    "CONFIG_FILE",
    "INDEX_FILE",
    "SINGLE_FILE",
    "HFCheckpoint",
    "dtype_name",
    "parse_size",
    "write_config",
    "write_safetensors",
]

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _safetensors() -> ModuleType:
    module = _optional.safetensors()
    if module is None:
        raise ImportError(
            "reading and writing Hugging Face checkpoints needs safetensors: "
            + _optional.missing_reason("safetensors")
        )
    return module


class HFCheckpoint:
    """A Hugging Face model directory, opened lazily: its config, tensor names and shapes, and tensors (or
    slices of them) read on demand. Use as a context manager, or ``close()`` it, to release the files.
    ``bytes_read`` counts the bytes ``read`` has returned so far (a slice counts its own size only).

    Raises (on opening):
        FileNotFoundError: naming what is missing: the directory, config.json, any safetensors, or a shard
            the index lists.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._safetensors = _safetensors()
        if not self.path.is_dir():
            raise FileNotFoundError(f"{self.path} is not a directory (a Hugging Face model directory)")
        config_file = self.path / CONFIG_FILE
        if not config_file.is_file():
            raise FileNotFoundError(f"{self.path} has no {CONFIG_FILE}")
        self.config: dict[str, Any] = json.loads(config_file.read_text())
        self._file_of: dict[str, Path] = {}  # tensor name -> file
        self._open: dict[Path, Any] = {}
        self.bytes_read = 0
        index = self.path / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index} has no weight_map")
            for name, file in weight_map.items():
                self._file_of[name] = self.path / file
            for file in sorted(set(self._file_of.values())):
                if not file.is_file():
                    raise FileNotFoundError(
                        f"shard {file.name} listed in {INDEX_FILE} is missing from {self.path}"
                    )
        elif (self.path / SINGLE_FILE).is_file():
            self._file_of = dict.fromkeys(
                self._handle(self.path / SINGLE_FILE).keys(), self.path / SINGLE_FILE
            )
        else:
            found = sorted(p.name for p in self.path.iterdir())
            raise FileNotFoundError(
                f"{self.path} has neither {SINGLE_FILE} nor {INDEX_FILE} (found: {found[:10]}); only "
                "safetensors checkpoints are read (re-save others with safe_serialization=True)"
            )

    def _handle(self, file: Path) -> Any:
        if file not in self._open:
            self._open[file] = self._safetensors.safe_open(str(file), framework="pt", device="cpu")
        return self._open[file]

    def keys(self) -> list[str]:
        """The names of the stored tensors."""
        return list(self._file_of)

    def __contains__(self, name: object) -> bool:
        return name in self._file_of

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def _file(self, name: str) -> Path:
        if name not in self._file_of:
            raise KeyError(f"the checkpoint in {self.path} has no tensor {name}")
        return self._file_of[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, from its file's header (no data read)."""
        return tuple(self._handle(self._file(name)).get_slice(name).get_shape())

    def nbytes(self, name: str) -> int:
        """A tensor's stored size in bytes, from its file's header (no data read)."""
        info = self._handle(self._file(name)).get_slice(name)
        numel = 1
        for n in info.get_shape():
            numel *= n
        bits = re.search(r"\d+", info.get_dtype())  # "BF16" -> 16, "F8_E4M3" -> 8; "BOOL" has none: a byte
        return numel * (int(bits.group()) // 8 if bits else 1)

    def read(self, name: str, index: Any = None) -> torch.Tensor:
        """A tensor, or only ``index`` of it (e.g. ``slice(0, 64)`` for its first 64 rows, or a tuple of
        slices), read from disk as stored (same dtype)."""
        handle = self._handle(self._file(name))
        tensor = handle.get_tensor(name) if index is None else handle.get_slice(name)[index]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def close(self) -> None:
        """Release the open files."""
        self._open.clear()

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


# ---- writing ------------------------------------------------------------------------------------------------

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_size(size: int | str) -> int:
    """Bytes of ``size``: an int, or a string as transformers takes it ("5GB" = 5·10⁹, "500MiB" = 500·2²⁰,
    "1000" = 1000 bytes)."""
    if isinstance(size, int):
        if size < 1:
            raise ValueError(f"a shard size must be >= 1 byte, got {size}")
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", size.upper())
    if match is None:
        raise ValueError(f"cannot read the size {size!r}: give bytes (an int) or e.g. '5GB', '500MB', '2GiB'")
    return parse_size(int(float(match.group(1)) * _UNITS[match.group(2) or "B"]))


def write_safetensors(
    tensors: Mapping[str, torch.Tensor], path: str | Path, max_shard_size: int | str = "5GB"
) -> list[Path]:
    """Write ``tensors`` into ``path`` as one ``model.safetensors``, or as shards of at most
    ``max_shard_size`` bytes (a larger tensor gets a shard of its own) with ``model.safetensors.index.json``,
    in the given order. Safetensors files an earlier save left there are removed first, so no stale shard
    remains. Returns the files written."""
    st = _safetensors()
    path = Path(path)
    limit = parse_size(max_shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.untyped_storage().nbytes() != nbytes:  # a view into a larger buffer (ZeRO-1's flat
            tensor = tensor.clone()  # buckets): safetensors refuses tensors that share storage
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    path.mkdir(parents=True, exist_ok=True)
    for old in path.iterdir():
        if old.name in (SINGLE_FILE, INDEX_FILE) or _SHARD.fullmatch(old.name):
            old.unlink()
    if len(shards) == 1:
        files = [path / SINGLE_FILE]
    else:
        files = [path / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for file, shard in zip(files, shards, strict=True):
        st.torch.save_file(dict(shard), str(file), metadata={"format": "pt"})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map = {name: file.name for file, shard in zip(files, shards) for name in shard}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        files.append(path / INDEX_FILE)
    return files


def write_config(config: Mapping[str, Any], path: str | Path) -> Path:
    """Write ``config`` as ``path/config.json`` (keys sorted, as transformers writes it)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    file = path / CONFIG_FILE
    file.write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
    return file


def dtype_name(dtype: torch.dtype) -> str:
    """transformers' spelling of a dtype in config.json ("bfloat16")."""
    return str(dtype).removeprefix("torch.")
