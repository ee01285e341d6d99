"""The embedded default dataset: the Python standard library's own source files, as WebDataset shards.

Real text (code, comments and docstrings) that every machine with Python has and nobody here wrote, so the
main job and the examples train on something real without a download. One document per file; a file goes
to the held-out split when a hash of its path relative to the stdlib says so (stable across machines and
runs, independent of the file order), so train and validation never share a file. Test suites
(``test/``, ``tests/``, ``idle_test/``) and ``site-packages`` are left out.

Shards are built once per output directory and Python version (`build_stdlib_shards` returns the cached ones
after that); a lock makes concurrent builders wait for the first.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from megascale.data.writer import ShardWriter

__all__ = ["StdlibShards", "build_stdlib_shards", "stdlib_files"]

_SKIP = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
_MARKER = "stdlib.json"


@dataclass(frozen=True)
class StdlibShards:
    """Where the shards are: ``train`` and ``val`` are brace patterns a `Source` reads."""

    train: str
    val: str
    train_docs: int
    val_docs: int
    bytes: int
    python: str


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted, without test suites and site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(root.rglob("*.py")) if not _SKIP & set(p.relative_to(root).parts)]
    if not files:
        raise FileNotFoundError(
            f"no Python sources under {root}: this Python ships without its stdlib sources"
        )
    return files


def _held_out(relative: str, val_percent: float) -> bool:
    digest = int.from_bytes(hashlib.sha256(relative.encode()).digest()[:8], "big")
    return digest % 10_000 < val_percent * 100


def _documents(files: list[Path], root: Path, val: bool, val_percent: float) -> Iterator[str]:
    for path in files:
        if _held_out(path.relative_to(root).as_posix(), val_percent) == val:
            yield path.read_text(encoding="utf-8", errors="replace")


def build_stdlib_shards(
    output: str | Path, *, val_percent: float = 5.0, max_docs: int = 32, force: bool = False
) -> StdlibShards:
    """Write (or find, when already built for this Python) the stdlib as train and validation shards.

    Args:
        output: a local directory; shards go to ``train-*.tar`` and ``val-*.tar`` inside it.
        val_percent: share of files held out for validation.
        max_docs: files per training shard (the default makes ~22, enough lanes for a global batch of 16;
            validation shards hold an eighth).
        force: rebuild even when a finished build is there.
    """
    if not 0 < val_percent < 100:
        raise ValueError(f"val_percent must be in (0, 100), got {val_percent}")
    out = Path(output).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    python = f"{sys.implementation.name} {sys.version.split()[0]}"
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second builder waits, then finds the first one's shards
        marker = out / _MARKER
        if marker.exists() and not force:
            built = json.loads(marker.read_text())
            same = (built.pop("python_build", None), built.pop("val_percent", None)) == (python, val_percent)
            if same and built.pop("max_docs", None) == max_docs:
                return StdlibShards(**built)
        return _build(out, python, val_percent, max_docs)


def _build(out: Path, python: str, val_percent: float, max_docs: int) -> StdlibShards:
    (out / _MARKER).unlink(missing_ok=True)  # written last: its absence means "not built"
    for old in [*out.glob("train-*.tar"), *out.glob("val-*.tar")]:
        old.unlink()
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files()
    patterns, counts, total = {}, {}, 0
    for split in ("train", "val"):
        # the held-out split is small: smaller shards, so several lanes (data-parallel ranks) can read it
        per_shard = max_docs if split == "train" else max(1, max_docs // 8)
        writer = ShardWriter(str(out), split, per_shard, 256 * 2**20, {})
        try:
            docs = _documents(files, root, split == "val", val_percent)
            for doc in tqdm(docs, desc=f"stdlib {split} shards", unit="file", file=sys.stderr, disable=None):
                writer.write(doc)
        finally:
            writer.close()
        patterns[split], counts[split], total = writer.pattern(), writer.docs, total + writer.bytes
    shards = StdlibShards(patterns["train"], patterns["val"], counts["train"], counts["val"], total, python)
    tmp = out / (_MARKER + ".tmp")
    settings = {"python_build": python, "val_percent": val_percent, "max_docs": max_docs}
    tmp.write_text(json.dumps({**asdict(shards), **settings}))
    shutil.move(tmp, out / _MARKER)
    return shards
