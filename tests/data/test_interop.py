"""webdataset interop, both ways, document for document, and the `inspect` and `convert` commands.

Shards written by webdataset's own `ShardWriter`/`TarWriter` (plain and gzip, with extra members per sample)
are read by megascale-data; shards written by `megascale-data shard` and `convert` are read by
`webdataset.WebDataset` with the same keys and texts. webdataset imports torch, so it stays out of the reader
process; here it runs in the test process only.
"""

from __future__ import annotations

import json

import pytest

from megascale.data import Source
from megascale.data.cli import main
from megascale.data.sources import iter_samples, list_shards
from tests.data._shards import make_doc, write_jsonl_files, write_parquet_files

wds = pytest.importorskip("webdataset")


def _docs(n: int) -> list[str]:
    return [make_doc(0, j, doc_chars=80, seed=7) + " ünï ☃" for j in range(n)]


@pytest.mark.parametrize("compress", [False, True], ids=["tar", "tar.gz"])
def test_shards_written_by_webdatasets_shardwriter_are_read_document_for_document(tmp_path, compress):
    docs = _docs(23)
    ext = "tar.gz" if compress else "tar"
    with wds.ShardWriter(str(tmp_path / f"w-%06d.{ext}"), maxcount=10, verbose=0) as sink:
        for j, doc in enumerate(docs):
            sink.write({"__key__": f"doc{j:04d}", "txt": doc, "json": {"n": j}})
    units = list_shards(Source(str(tmp_path / f"w-{{000000..000002}}.{ext}")))
    samples = [s for u in units for s in iter_samples(u)]
    assert [s["__key__"] for s in samples] == [f"doc{j:04d}" for j in range(23)]
    assert [s["txt"].decode() for s in samples] == docs
    assert [json.loads(s["json"])["n"] for s in samples] == list(range(23))


def test_shards_written_by_megascale_data_are_read_by_webdataset(tmp_path, capsys):
    docs = _docs(17)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "all.txt").write_text("\n".join(docs) + "\n")
    assert (
        main(["shard", str(corpus), "--output", str(tmp_path / "out"), "--split", "line", "--max-docs", "5"])
        == 0
    )
    pattern = capsys.readouterr().out.strip().split()[-1]
    samples = list(wds.WebDataset(pattern, shardshuffle=False, empty_check=False))
    assert [s["__key__"] for s in samples] == [f"{j:09d}" for j in range(17)]
    assert [s["txt"].decode() for s in samples] == docs


def test_convert_writes_parquet_and_jsonl_as_shards_webdataset_reads(tmp_path, capsys):
    pytest.importorskip("pyarrow")
    pytest.importorskip("zstandard")
    parquet, pdocs = write_parquet_files(str(tmp_path / "p"), 2, 2, 3)
    jsonl, jdocs = write_jsonl_files(str(tmp_path / "j"), 2, 4, zstd=True)
    for pattern, docs, out in ((parquet, pdocs, "pt"), (jsonl, jdocs, "jt")):
        assert main(["convert", pattern, "--output", str(tmp_path / out), "--max-docs", "4"]) == 0
        written = capsys.readouterr().out.strip().split()[-1]
        samples = list(wds.WebDataset(written, shardshuffle=False, empty_check=False))
        assert [s["txt"].decode() for s in samples] == [d for unit in docs for d in unit]
    assert main(["convert", parquet, "--output", str(tmp_path / "pt")]) == 2  # no silent overwrite
    assert "already holds" in capsys.readouterr().err


def test_inspect_counts_documents_bytes_and_tokens(tmp_path, capsys):
    pytest.importorskip("pyarrow")
    parquet, pdocs = write_parquet_files(str(tmp_path / "p"), 2, 3, 5, doc_chars=50)
    assert main(["inspect", parquet]) == 0
    report = json.loads(capsys.readouterr().out)
    text_bytes = sum(len(d.encode()) for unit in pdocs for d in unit)
    assert report == {
        "format": "parquet", "files": 2, "units": 6, "documents": 30, "text_bytes": text_bytes,
        "tokens_estimate": text_bytes, "tokens_per_byte": 1.0, "exact": True,  # bytes tokenizer: 1 per byte
        "corrupt_units": 0, "skipped_records": 0,
    }  # fmt: skip
    jsonl, _ = write_jsonl_files(str(tmp_path / "j"), 4, 10, doc_chars=50)
    assert main(["inspect", jsonl, "--sample-units", "1"]) == 0
    sampled = json.loads(capsys.readouterr().out)
    assert sampled["exact"] is False and sampled["units"] == 4 and 36 <= sampled["documents"] <= 44
    assert main(["inspect", parquet, "--text-key", "body"]) == 2
    assert "no column 'body'" in capsys.readouterr().err
