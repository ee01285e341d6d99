"""Test helpers: write small WebDataset text shards (local or any fsspec URL) and damage them on purpose."""

from __future__ import annotations

import io
import random
import string
import tarfile
from typing import Any

from megascale.data.sources import open_output

__all__ = [
    "corrupt_shard",
    "make_doc",
    "truncate_shard",
    "write_corpus",
    "write_jsonl_files",
    "write_parquet_files",
    "write_tar",
    "write_text_shards",
]


def make_doc(shard: int, doc: int, *, doc_chars: int = 100, seed: int = 0) -> str:
    """A deterministic ASCII document of about `doc_chars` characters naming its shard and index."""
    head = f"shard {shard} doc {doc} "
    rng = random.Random(f"{seed}-{shard}-{doc}")
    filler = "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(max(doc_chars - len(head), 0)))
    return head + filler


def write_tar(
    url: str,
    members: list[tuple[str, bytes]],
    *,
    storage_options: dict[str, Any] | None = None,
    compress: bool = False,
) -> None:
    """Write a tar file (gzip-compressed if `compress`) holding `members` (name, data) in order."""
    mode = "w|gz" if compress else "w|"
    with open_output(url, storage_options) as f, tarfile.open(fileobj=f, mode=mode) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))


def write_text_shards(
    target: str,
    n_shards: int,
    docs_per_shard: int,
    *,
    doc_chars: int = 100,
    seed: int = 0,
    storage_options: dict[str, Any] | None = None,
    prefix: str = "part",
) -> tuple[str, list[list[str]]]:
    """Write `n_shards` shards of `docs_per_shard` text documents each under the directory `target`.

    Sample keys are global document numbers (``f"{n:09d}"``), as ``megascale-data shard`` writes them.

    Returns:
        The brace pattern naming the shards (``TARGET/PREFIX-{000000..0000NN}.tar``) and the documents of
        each shard, in order.
    """
    target = target.rstrip("/")
    docs: list[list[str]] = []
    for i in range(n_shards):
        docs.append([make_doc(i, j, doc_chars=doc_chars, seed=seed) for j in range(docs_per_shard)])
        members = [(f"{i * docs_per_shard + j:09d}.txt", d.encode()) for j, d in enumerate(docs[i])]
        write_tar(f"{target}/{prefix}-{i:06d}.tar", members, storage_options=storage_options)
    return f"{target}/{prefix}-{{000000..{n_shards - 1:06d}}}.tar", docs


def write_jsonl_files(
    target: str,
    n_files: int,
    docs_per_file: int,
    *,
    doc_chars: int = 100,
    seed: int = 0,
    zstd: bool = False,
    storage_options: dict[str, Any] | None = None,
    prefix: str = "part",
) -> tuple[str, list[list[str]]]:
    """JSON Lines files (``{"id": ..., "text": ...}`` per line; zstd-compressed if ``zstd``) of the same
    documents `write_text_shards` writes; returns their brace pattern and each file's documents."""
    import json

    target = target.rstrip("/")
    ext = "jsonl.zst" if zstd else "jsonl"
    docs: list[list[str]] = []
    for i in range(n_files):
        docs.append([make_doc(i, j, doc_chars=doc_chars, seed=seed) for j in range(docs_per_file)])
        data = "".join(
            json.dumps({"id": i * docs_per_file + j, "text": d}) + "\n" for j, d in enumerate(docs[i])
        )
        raw = data.encode()
        if zstd:
            import zstandard

            raw = zstandard.ZstdCompressor().compress(raw)
        with open_output(f"{target}/{prefix}-{i:06d}.{ext}", storage_options) as f:
            f.write(raw)
    return f"{target}/{prefix}-{{000000..{n_files - 1:06d}}}.{ext}", docs


def write_parquet_files(
    target: str,
    n_files: int,
    groups_per_file: int,
    docs_per_group: int,
    *,
    doc_chars: int = 100,
    seed: int = 0,
    storage_options: dict[str, Any] | None = None,
    prefix: str = "part",
) -> tuple[str, list[list[str]]]:
    """Parquet files with a ``text`` column (and an ``id``), ``groups_per_file`` row groups of
    ``docs_per_group`` rows each; returns their brace pattern and each row group's documents, in order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    target = target.rstrip("/")
    docs: list[list[str]] = []
    for i in range(n_files):
        with open_output(f"{target}/{prefix}-{i:06d}.parquet", storage_options) as f:
            schema = pa.schema([("id", pa.int64()), ("text", pa.string())])
            with pq.ParquetWriter(f, schema) as writer:
                for g in range(groups_per_file):
                    unit = i * groups_per_file + g
                    group = [make_doc(unit, j, doc_chars=doc_chars, seed=seed) for j in range(docs_per_group)]
                    docs.append(group)
                    ids = list(range(unit * docs_per_group, (unit + 1) * docs_per_group))
                    writer.write_table(pa.table({"id": ids, "text": group}, schema=schema))
    return f"{target}/{prefix}-{{000000..{n_files - 1:06d}}}.parquet", docs


def write_corpus(
    fmt: str, target: str, n_units: int, docs_per_unit: int, **kwargs: Any
) -> tuple[str, list[list[str]]]:
    """``n_units`` units (shards, files, row groups) of documents in format ``fmt`` ("tar", "jsonl",
    "jsonl.zst", "parquet": two row groups per file)."""
    if fmt == "tar":
        return write_text_shards(target, n_units, docs_per_unit, **kwargs)
    if fmt in ("jsonl", "jsonl.zst"):
        return write_jsonl_files(target, n_units, docs_per_unit, zstd=fmt == "jsonl.zst", **kwargs)
    assert fmt == "parquet" and n_units % 2 == 0
    return write_parquet_files(target, n_units // 2, 2, docs_per_unit, **kwargs)


def _offsets(path: str) -> list[tuple[int, int]]:
    with tarfile.open(path) as tar:
        return [(m.offset, m.offset_data + m.size) for m in tar.getmembers()]


def corrupt_shard(path: str, member: int | None = None) -> int:
    """Overwrite the tar header of one member (default: the middle one) of a local shard with garbage.

    Returns:
        The index of the damaged member. In a shard of one member per sample, a reader yields the samples
        before it except the last one (the sample in progress when damage is found is dropped).
    """
    offsets = _offsets(path)
    member = len(offsets) // 2 if member is None else member
    with open(path, "r+b") as f:
        f.seek(offsets[member][0])
        f.write(b"\xa5" * 512)
    return member


def truncate_shard(path: str, member: int | None = None) -> int:
    """Cut a local shard in the middle of one member's data (default: the middle member).

    Returns:
        The index of the cut member. In a shard of one member per sample, a reader yields exactly the
        samples before it.
    """
    offsets = _offsets(path)
    member = len(offsets) // 2 if member is None else member
    header, end = offsets[member]
    with open(path, "r+b") as f:
        f.truncate(header + 512 + (end - header - 512) // 2)
    return member
