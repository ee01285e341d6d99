"""Naming, checking and reading WebDataset shards, locally and on S3 (moto), with damage and outages."""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from megascale.data.sources import (
    CorruptShardError,
    DataSourceError,
    ReadStats,
    ShardNotFoundError,
    ShardReadError,
    Source,
    expand_urls,
    iter_samples,
    list_shards,
)
from tests.data._shards import corrupt_shard, make_doc, truncate_shard, write_tar, write_text_shards


def _texts(samples: Iterator[dict]) -> list[str]:
    return [s["txt"].decode() for s in samples]


# ------------------------------------------------------------------------------------------- naming


def test_expand_braces_keep_order_and_padding(tmp_path):
    urls = expand_urls(f"{tmp_path}/x-{{0008..0011}}.tar")
    assert urls == [f"{tmp_path}/x-{i:04d}.tar" for i in (8, 9, 10, 11)]
    assert expand_urls(["s3://b/a-{1..2}.tar", "/d/z.tar"]) == [
        "s3://b/a-1.tar",
        "s3://b/a-2.tar",
        "/d/z.tar",
    ]


def test_expand_globs_sorted_and_relative_paths_absolute(tmp_path, monkeypatch):
    for name in ["b.tar", "a.tar", "c.txt"]:
        (tmp_path / name).write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    assert expand_urls("*.tar") == [str(tmp_path / "a.tar"), str(tmp_path / "b.tar")]
    assert expand_urls("rel/x.tar") == [str(tmp_path / "rel" / "x.tar")]
    assert expand_urls("*.none") == []


def test_source_validates_weight():
    with pytest.raises(ValueError, match="weight"):
        Source("/d/x.tar", weight=0)
    with pytest.raises(ValueError, match="weight"):
        Source("/d/x.tar", weight=float("nan"))


def test_a_config_whose_source_is_not_a_source_says_what_to_write():
    from megascale.data import WebDataConfig

    with pytest.raises(TypeError, match=r"sources\[0\] is \{'url': .*'urls' required"):
        WebDataConfig(sources=[{"url": "/d/x.tar"}], seq_len=8, batch_size=1)


def test_config_type_hints_resolve_so_yaml_configs_build_sources():
    """LightningCLI/jsonargparse build nested dataclasses from type hints: they must resolve."""
    import typing

    from megascale.data import WebDataConfig

    hints = typing.get_type_hints(WebDataConfig)
    assert hints["sources"] == list[Source]
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser()
    parser.add_argument("--data", type=WebDataConfig)
    parsed = parser.parse_args(['--data={"sources": [{"urls": "/d/x.tar"}], "seq_len": 8, "batch_size": 1}'])
    assert parser.instantiate(parsed).data.sources == [Source("/d/x.tar")]


# ------------------------------------------------------------------------------------------- local


def test_local_shards_read_back_in_order(tmp_path):
    pattern, docs = write_text_shards(str(tmp_path), n_shards=3, docs_per_shard=4)
    urls = list_shards(Source(pattern))
    assert urls == [f"{tmp_path}/part-{i:06d}.tar" for i in range(3)]
    stats = ReadStats()
    for url, shard_docs in zip(urls, docs):
        samples = list(iter_samples(url, stats=stats))
        assert _texts(samples) == shard_docs
        assert all(s["__url__"] == url for s in samples)
    assert samples[0]["__key__"] == "000000008"
    assert stats.as_dict() == {
        "shards_opened": 3,
        "samples": 12,
        "retries": 0,
        "corrupt_shards": 0,
        "skipped_samples": 0,
    }


def test_members_grouped_like_webdataset(tmp_path):
    url = str(tmp_path / "g.tar")
    members = [
        ("__index__", b"meta"),  # WebDataset skips __...__ members
        ("dir/a.txt", b"A"),
        ("dir/a.meta.JSON", b"{}"),  # key up to the first dot, extension lower-cased
        ("b.txt", b"B"),
        ("noext", b"?"),  # no extension: skipped
        ("c.txt", b"C"),
    ]
    write_tar(url, members)
    samples = list(iter_samples(url))
    assert [s["__key__"] for s in samples] == ["dir/a", "b", "c"]
    assert samples[0] == {"__key__": "dir/a", "__url__": url, "txt": b"A", "meta.json": b"{}"}


def test_duplicate_member_is_corrupt(tmp_path):
    url = str(tmp_path / "d.tar")
    write_tar(url, [("a.txt", b"1"), ("a.txt", b"2")])
    with pytest.raises(CorruptShardError, match="duplicate"):
        list(iter_samples(url, on_corrupt="raise"))


def test_missing_shard_named(tmp_path):
    write_text_shards(str(tmp_path), n_shards=2, docs_per_shard=1)
    with pytest.raises(ShardNotFoundError, match=r"part-000002\.tar"):
        list_shards(Source(f"{tmp_path}/part-{{000000..000002}}.tar"))
    with pytest.raises(ShardNotFoundError, match=r"nope\.tar"):
        list(iter_samples(str(tmp_path / "nope.tar")))
    with pytest.raises(ShardNotFoundError):
        list_shards(Source(str(tmp_path / "missing-dir" / "x.tar")))


def test_empty_source_is_an_error(tmp_path):
    with pytest.raises(DataSourceError, match="matched no shards"):
        list_shards(Source(f"{tmp_path}/*.tar"))
    with pytest.raises(DataSourceError, match="matched no shards"):
        list_shards(Source([]))


@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_damaged_shard_warns_counts_or_raises(tmp_path, damage):
    pattern, docs = write_text_shards(str(tmp_path), n_shards=1, docs_per_shard=10)
    url = expand_urls(pattern)[0]
    member = corrupt_shard(url) if damage == "corrupt" else truncate_shard(url)
    # A bad header drops the sample in progress; a cut inside a member's data drops that member only.
    expected = docs[0][: member - 1 if damage == "corrupt" else member]
    stats = ReadStats()
    with pytest.warns(RuntimeWarning, match=rf"part-000000.tar .* after {len(expected)} samples"):
        assert _texts(iter_samples(url, stats=stats)) == expected
    assert (stats.corrupt_shards, stats.samples, stats.skipped_samples) == (1, len(expected), 1)
    with pytest.raises(CorruptShardError, match=r"part-000000\.tar"):
        list(iter_samples(url, on_corrupt="raise"))


def test_truncated_at_a_member_boundary_is_detected(tmp_path):
    """`tarfile` alone would end quietly at a missing end-of-archive marker."""
    url = str(tmp_path / "t.tar")
    write_tar(url, [("a.txt", b"x" * 512), ("b.txt", b"y" * 512)])
    with open(url, "r+b") as f:
        f.truncate(2048)  # two headers and two data blocks, no end marker
    with pytest.warns(RuntimeWarning, match="truncated"):
        assert [s["__key__"] for s in iter_samples(url)] == ["a"]


def test_damage_in_the_first_header_yields_nothing(tmp_path):
    pattern, _ = write_text_shards(str(tmp_path), n_shards=1, docs_per_shard=3)
    url = expand_urls(pattern)[0]
    corrupt_shard(url, member=0)
    stats = ReadStats()
    with pytest.warns(RuntimeWarning, match="after 0 samples"):
        assert list(iter_samples(url, stats=stats)) == []
    assert (stats.corrupt_shards, stats.skipped_samples) == (1, 0)


# ------------------------------------------------------------------------------------------- S3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_s3_shards_read_back(s3_server, s3_bucket):
    options = s3_server.storage_options
    pattern, docs = write_text_shards(f"s3://{s3_bucket}/d", 3, 5, storage_options=options)
    assert pattern == f"s3://{s3_bucket}/d/part-{{000000..000002}}.tar"
    urls = list_shards(Source(pattern, storage_options=options))
    assert urls == expand_urls(pattern)
    assert [_texts(iter_samples(u, storage_options=options)) for u in urls] == docs
    globbed = list_shards(Source(f"s3://{s3_bucket}/d/*.tar", storage_options=options))
    assert globbed == urls


def test_s3_missing_shard_and_empty_source(s3_server, s3_bucket):
    options = s3_server.storage_options
    write_text_shards(f"s3://{s3_bucket}/d", 2, 1, storage_options=options)
    with pytest.raises(ShardNotFoundError, match=r"part-000003\.tar"):
        list_shards(Source(f"s3://{s3_bucket}/d/part-{{000000..000003}}.tar", storage_options=options))
    with pytest.raises(DataSourceError, match="matched no shards"):
        list_shards(Source(f"s3://{s3_bucket}/other/*.tar", storage_options=options))
    with pytest.raises(ShardNotFoundError, match=r"part-000009\.tar"):
        list(iter_samples(f"s3://{s3_bucket}/d/part-000009.tar", storage_options=options))


def test_s3_bucket_that_does_not_exist(s3_server):
    source = Source("s3://no-such-bucket-x/d/part-{0..1}.tar", storage_options=s3_server.storage_options)
    with pytest.raises(DataSourceError, match="bucket 'no-such-bucket-x' does not exist") as info:
        list_shards(source)
    assert s3_server.endpoint_url in str(info.value)
    with pytest.raises(DataSourceError, match="bucket 'no-such-bucket-x' does not exist"):
        list_shards(Source("s3://no-such-bucket-x/d/*.tar", storage_options=s3_server.storage_options))


def test_s3_unreachable_endpoint_fails_fast(s3_env):
    endpoint = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    source = Source("s3://bkt/d/part-{0..1}.tar", storage_options={"endpoint_url": endpoint})
    start = time.monotonic()
    with pytest.raises(DataSourceError, match="endpoint_url") as info:
        list_shards(source, timeout=3)
    assert time.monotonic() - start < 6
    assert endpoint in str(info.value)


def test_s3_endpoint_that_never_answers_times_out(s3_env):
    with socket.socket() as silent:  # accepts connections (backlog) but never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        source = Source("s3://bkt/d/x.tar", storage_options={"endpoint_url": endpoint})
        start = time.monotonic()
        with pytest.raises(DataSourceError, match="could not be listed within 2 s"):
            list_shards(source, timeout=2)
        assert time.monotonic() - start < 6


def _outage_options(server) -> dict:
    # Small blocks so the shard is read in many requests; botocore fails at once when the server is down,
    # so the retries under test are iter_samples' own.
    config = {"connect_timeout": 1, "read_timeout": 2, "retries": {"total_max_attempts": 1}}
    return {**server.storage_options, "default_block_size": 16 * 1024, "config_kwargs": config}


@pytest.mark.parametrize("compress", [False, True], ids=["tar", "tar.gz"])
def test_s3_outage_mid_read_is_retried_without_duplicates(s3_outage_server, compress):
    server = s3_outage_server
    fs = server.fs()
    fs.call_s3("create_bucket", Bucket="outage")
    docs = [make_doc(0, i, doc_chars=1000) for i in range(300)]  # random letters: gzip leaves ~60%
    url = f"s3://outage/shard.tar{'.gz' if compress else ''}"
    members = [(f"{i:05d}.txt", d.encode()) for i, d in enumerate(docs)]
    write_tar(url, members, storage_options=server.storage_options, compress=compress)
    stats = ReadStats()
    texts = []
    restart = threading.Timer(1.0, server.start)
    for sample in iter_samples(url, storage_options=_outage_options(server), backoff=0.5, stats=stats):
        texts.append(sample["txt"].decode())
        if len(texts) == 20:
            server.stop()
            restart.start()
    restart.join()
    assert texts == docs
    assert stats.retries >= 1 and stats.samples == 300


def test_s3_lasting_outage_raises_shard_read_error(s3_outage_server):
    server = s3_outage_server
    server.fs().call_s3("create_bucket", Bucket="down")
    url = "s3://down/shard.tar"
    write_tar(
        url, [(f"{i:05d}.txt", b"x" * 2000) for i in range(200)], storage_options=server.storage_options
    )
    samples = iter_samples(url, storage_options=_outage_options(server), retries=2, backoff=0.1)
    next(samples)
    server.stop()
    start = time.monotonic()
    with pytest.raises(ShardReadError, match=r"s3://down/shard.tar after 3 attempts"):
        list(samples)
    assert time.monotonic() - start < 10


def test_sources_do_not_import_torch():
    import subprocess

    code = "import sys, megascale.data.sources, megascale.data.tokenize; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
