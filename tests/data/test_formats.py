"""Parquet and JSONL(.zst) sources beside tar shards: units, mixing, S3 range reads, and damaged input.

The loader tests (test_loader.py) run every format through tree loading, exact and elastic resume; here is
what is particular to a format: Parquet row groups as units read with byte ranges from S3, a Parquet and a tar
source mixed by weight, and each kind of bad input (missing text column, corrupt row group, truncated .zst,
a line that is not UTF-8 JSON) turned into a clear error or a counted skip, as for tar shards.
"""

from __future__ import annotations

import collections
import json
import random
import string
from unittest import mock

import pytest

from megascale.data import Source, WebDataConfig, WebLoader
from megascale.data.sources import (
    CorruptShardError,
    DataSourceError,
    ReadStats,
    iter_samples,
    list_shards,
)
from tests.data._shards import write_jsonl_files, write_parquet_files, write_text_shards

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")


def _texts(samples, key="text"):
    return [s[key].decode() for s in samples]


def test_parquet_row_groups_are_units_and_jsonl_files_read_back(tmp_path):
    pattern, docs = write_parquet_files(str(tmp_path / "p"), 2, 3, 4)
    units = list_shards(Source(pattern))
    assert units == [f"{tmp_path}/p/part-{i:06d}.parquet#row_group={g}" for i in range(2) for g in range(3)]
    assert [_texts(iter_samples(u)) for u in units] == docs
    for zstd in (False, True):
        jpattern, jdocs = write_jsonl_files(str(tmp_path / f"j{zstd}"), 2, 5, zstd=zstd)
        assert [_texts(iter_samples(u)) for u in list_shards(Source(jpattern))] == jdocs
    with pytest.raises(DataSourceError, match="mixes formats"):
        list_shards(Source([f"{tmp_path}/p/part-000000.parquet", f"{tmp_path}/jTrue/part-000000.jsonl.zst"]))


def test_a_parquet_and_a_tar_source_mix_by_weight(tmp_path):
    # Parquet documents are upper-case letters, tar documents (make_doc) lower-case: a window tells its source
    texts = [_incompressible(40, i).upper() for i in range(160)]
    root = tmp_path / "a"
    root.mkdir()
    for f in range(2):
        with pq.ParquetWriter(root / f"a-{f}.parquet", pa.schema([("text", pa.string())])) as writer:
            for g in range(2):
                writer.write_table(pa.table({"text": texts[(2 * f + g) * 40 : (2 * f + g + 1) * 40]}))
    b, _ = write_text_shards(str(tmp_path / "b"), 4, 40, doc_chars=40, seed=3, prefix="b")
    cfg = WebDataConfig(
        sources=[Source(f"{root}/*.parquet", weight=3.0), Source(b, weight=1.0)], seq_len=16, batch_size=8,
        lanes=4, num_workers=0, timeout=60,
    )  # fmt: skip
    counts = collections.Counter()
    for x, _ in WebLoader(cfg, tree=False, max_steps=100):
        for row in x.numpy():
            letters = [t for t in row.tolist() if 65 <= t <= 90 or 97 <= t <= 122]
            upper = sum(t <= 90 for t in letters)
            assert upper in (0, len(letters)), "a window mixes two sources"
            counts["parquet" if upper else "tar"] += 1
    n = counts["parquet"] + counts["tar"]
    assert n == 800
    # the tar source is drawn with p = 1/4: over 800 windows the share's std is ≈ 0.015; 4 std of slack
    assert abs(counts["tar"] / n - 0.25) < 0.06, counts


def _incompressible(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(string.ascii_letters) for _ in range(n))


def test_reading_one_row_group_from_s3_fetches_about_that_row_group(s3_server, s3_bucket, tmp_path):
    """Bytes fetched are counted by a spy on s3fs's range reads (the real HTTP server serves them)."""
    import s3fs

    options = s3_server.storage_options
    local = tmp_path / "big.parquet"
    with pq.ParquetWriter(local, pa.schema([("text", pa.string())]), compression="NONE") as writer:
        for g in range(4):
            writer.write_table(pa.table({"text": [_incompressible(1000, 100 * g + i) for i in range(200)]}))
    url = f"s3://{s3_bucket}/c/big.parquet"
    s3_server.fs().put(str(local), url)
    group_bytes = pq.ParquetFile(local).metadata.row_group(2).column(0).total_compressed_size
    size = local.stat().st_size
    fetched: list[int] = []
    original = s3fs.core.S3File._fetch_range

    def spy(self, start, end):
        fetched.append(end - start)
        return original(self, start, end)

    with mock.patch.object(s3fs.core.S3File, "_fetch_range", spy):
        units = list_shards(Source(url, storage_options=options))
        listed = sum(fetched)
        fetched.clear()
        rows = list(iter_samples(units[2], storage_options=options))
    assert len(units) == 4 and len(rows) == 200
    assert rows[0]["text"].decode() == _incompressible(1000, 200)
    # listing reads the footer only; one row group: its column chunk plus the footer read, not the file
    assert listed < 0.2 * size, (listed, size)
    assert group_bytes <= sum(fetched) < group_bytes + 0.2 * size, (sum(fetched), group_bytes, size)


def test_a_missing_text_column_is_named_before_any_data_is_read(tmp_path):
    pattern, _ = write_parquet_files(str(tmp_path), 1, 1, 3)
    with pytest.raises(DataSourceError, match=r"no column 'body' \(columns: id, text\)"):
        list_shards(Source(pattern, text_key="body"))
    assert len(list_shards(Source(pattern, text_key="text"))) == 1


def test_a_corrupt_row_group_ends_that_unit_counted_or_raised(tmp_path):
    pattern, docs = write_parquet_files(str(tmp_path), 1, 3, 5)
    path = tmp_path / "part-000000.parquet"
    column = pq.ParquetFile(path).metadata.row_group(1).column(1)
    data = bytearray(path.read_bytes())
    data[column.data_page_offset : column.data_page_offset + 64] = b"\xa5" * 64
    path.write_bytes(data)
    units = list_shards(Source(pattern))
    stats = ReadStats()
    assert _texts(iter_samples(units[0], stats=stats)) == docs[0]  # the other row groups read as before
    assert _texts(iter_samples(units[2], stats=stats)) == docs[2]
    with pytest.warns(RuntimeWarning, match=r"row_group=1 is corrupt"):
        assert list(iter_samples(units[1], stats=stats, retries=0)) == []
    assert stats.corrupt_shards == 1 and stats.retries == 0  # damage is not retried as a network failure
    with pytest.raises(CorruptShardError, match="rewrite or remove"):
        list(iter_samples(units[1], on_corrupt="raise"))


def test_a_truncated_zst_ends_the_file_counted_or_raised(tmp_path):
    _, docs = write_jsonl_files(str(tmp_path), 1, 2000, zstd=True)
    path = tmp_path / "part-000000.jsonl.zst"
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    stats = ReadStats()
    with pytest.warns(RuntimeWarning, match=r"corrupt or truncated .*\(truncated\)"):
        texts = _texts(iter_samples(str(path), stats=stats))
    assert texts == docs[0][: len(texts)] and len(texts) < len(docs[0])  # what was read before, in order
    assert stats.corrupt_shards == 1
    with pytest.raises(CorruptShardError):
        list(iter_samples(str(path), on_corrupt="raise"))


def test_lines_that_are_not_utf8_json_objects_are_skipped_and_counted(tmp_path):
    path = tmp_path / "mixed.jsonl"
    lines = [
        json.dumps({"text": "first"}).encode(),
        b"\xff\xfe not utf-8",
        b"[1, 2, 3]",
        json.dumps({"body": "no text field"}).encode(),
        b"{broken json",
        json.dumps({"text": "last"}).encode(),
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    samples = list(iter_samples(str(path)))
    assert [s.get("text") for s in samples] == [b"first", None, None, None, None, b"last"]
    cfg = WebDataConfig(sources=[Source(str(path))], seq_len=4, batch_size=1, num_workers=0, timeout=30)
    loader = WebLoader(cfg, tree=False, max_steps=2)
    list(loader)
    assert loader.stats["skipped_samples"] >= 4
