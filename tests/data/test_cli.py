"""`megascale-data shard`: text files in, shards out that `Source`/`iter_samples` read back."""

from __future__ import annotations

import json
import re

import pytest

from megascale.data.cli import main, parse_size
from megascale.data.sources import Source, iter_samples, list_shards

SUMMARY = re.compile(r"wrote (\d+) documents \((\d+) bytes\) into (\d+) shards: (\S+)")


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("first para\nstill first\n\nsecond para\n\n\nthird para\n")
    (root / "sub" / "b.txt").write_text("über ☃ line one\n\n  \nline two\n")
    (root / "c.txt").write_text("  \n")  # blank: no document in any split
    (root / "notes.md").write_text("not a .txt file\n")
    return root


def _run(capsys, *argv: str, options: dict | None = None) -> tuple[list[str], int, list[str]]:
    """Run the command; returns the documents read back, the shard count, and the shard URLs."""
    assert main(["shard", *argv]) == 0
    match = SUMMARY.search(capsys.readouterr().out)
    assert match, "no summary line"
    n_docs, n_bytes, n_shards, pattern = match.groups()
    urls = list_shards(Source(pattern, storage_options=options))
    samples = [s for url in urls for s in iter_samples(url, storage_options=options)]
    assert [s["__key__"] for s in samples] == [f"{i:09d}" for i in range(int(n_docs))]
    texts = [s["txt"].decode() for s in samples]
    assert int(n_bytes) == sum(len(t.encode()) for t in texts)
    assert len(urls) == int(n_shards)
    return texts, int(n_shards), urls


def test_split_file_line_paragraph(corpus, tmp_path, capsys):
    a, b = (corpus / "a.txt").read_text(), (corpus / "sub" / "b.txt").read_text()
    texts, shards, urls = _run(capsys, str(corpus), "--output", str(tmp_path / "f"))
    assert (texts, shards) == ([a, b], 1)  # sorted paths, the blank file skipped, notes.md ignored
    assert urls == [str(tmp_path / "f" / "part-000000.tar")]
    texts, _, _ = _run(capsys, str(corpus), "--output", str(tmp_path / "l"), "--split", "line")
    assert texts == ["first para", "still first", "second para", "third para", "über ☃ line one", "line two"]
    texts, _, _ = _run(capsys, str(corpus), "--output", str(tmp_path / "p"), "--split", "paragraph")
    assert texts == ["first para\nstill first", "second para", "third para", "über ☃ line one", "line two"]


def test_rolls_over_at_max_docs_and_max_bytes(tmp_path, capsys):
    src = tmp_path / "lines.txt"
    src.write_text("".join(f"line {i:02d}\n" for i in range(10)))  # 7 bytes per document
    out = tmp_path / "out"
    texts, shards, urls = _run(capsys, str(src), "--output", str(out), "--split", "line", "--max-docs", "3")
    assert (len(texts), shards) == (10, 4)
    assert urls[-1] == str(out / "part-000003.tar")
    assert [len(list(iter_samples(u))) for u in urls] == [3, 3, 3, 1]
    texts, shards, _ = _run(
        capsys,
        str(src),
        "--output",
        str(tmp_path / "b"),
        "--split",
        "line",
        "--max-bytes",
        "20",
        "--prefix",
        "x",
    )
    assert (len(texts), shards) == (10, 5)  # two documents of 7 bytes fit in 20, three do not


def test_shuffle_is_a_seeded_permutation(tmp_path, capsys):
    src = tmp_path / "lines.txt"
    lines = [f"line {i}" for i in range(50)]
    src.write_text("\n".join(lines))
    args = [str(src), "--split", "line", "--shuffle", "--seed", "3"]
    first, _, _ = _run(capsys, *args, "--output", str(tmp_path / "s1"))
    again, _, _ = _run(capsys, *args, "--output", str(tmp_path / "s2"))
    assert first == again != lines and sorted(first) == sorted(lines)


def test_refuses_to_mix_with_existing_shards(corpus, tmp_path, capsys):
    out = str(tmp_path / "out")
    _run(capsys, str(corpus), "--output", out, "--split", "line", "--max-docs", "2")
    assert main(["shard", str(corpus), "--output", out]) == 2
    assert "--overwrite" in capsys.readouterr().err
    texts, shards, _ = _run(capsys, str(corpus), "--output", out, "--overwrite")
    assert (len(texts), shards) == (2, 1)  # the three older shards are gone


@pytest.mark.parametrize("case", ["no-txt-files", "only-blank", "missing"])
def test_empty_inputs_exit_2(tmp_path, capsys, case):
    (tmp_path / "in").mkdir()
    if case == "no-txt-files":
        (tmp_path / "in" / "x.md").write_text("text")
    elif case == "only-blank":
        (tmp_path / "in" / "x.txt").write_text("\n \n")
    source = str(tmp_path / ("nowhere" if case == "missing" else "in"))
    assert main(["shard", source, "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "error" in err and ("does not exist" in err or "no .txt files" in err or "no documents" in err)
    assert not (tmp_path / "out").exists()


def test_shard_to_s3(corpus, s3_server, s3_bucket, capsys):
    options = s3_server.storage_options
    argv = [str(corpus), "--output", f"s3://{s3_bucket}/corpus", "--split", "line", "--max-docs", "4"]
    argv += [f"--storage-option={k}={v}" for k, v in options.items()]
    texts, shards, urls = _run(capsys, *argv, options=options)
    assert (len(texts), shards) == (6, 2)
    assert urls == [f"s3://{s3_bucket}/corpus/part-00000{i}.tar" for i in range(2)]


def test_parse_size():
    assert parse_size("4096") == 4096
    assert parse_size("64MB") == 64 * 10**6
    assert parse_size("1GiB") == 2**30
    assert parse_size("1.5k") == 1500


def test_tokenizer_trains_a_bpe_that_a_source_reads(tmp_path, capsys):
    import json

    pytest.importorskip("tokenizers")
    from megascale.data import load_tokenizer

    assert (
        main(["tokenizer", "--output", str(tmp_path / "bpe"), "--vocab-size", "300", "--max-bytes", "200KB"])
        == 0
    )
    summary = json.loads(capsys.readouterr().out)
    assert summary == {"tokenizer": str(tmp_path / "bpe"), "vocab_size": 300, "eos_id": 0}
    assert (
        load_tokenizer(summary["tokenizer"]).decode(load_tokenizer(summary["tokenizer"]).encode("x = 1"))
        == "x = 1"
    )
    assert main(["tokenizer", "--output", str(tmp_path / "small"), "--vocab-size", "10"]) == 2
    assert "at least 257" in capsys.readouterr().err


def test_inspect_names_the_keys_when_no_record_has_the_text_field(tmp_path, capsys):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"id": 1, "content": "hello"}\n{"id": 2, "content": "world"}\n')
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert "none of the 2 records read has a text field 'text'" in err
    assert "first record has the keys ['content', 'id']" in err and "--text-key NAME" in err
    assert main(["inspect", str(path), "--text-key", "content"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["documents"] == 2 and report["exact"] is True
    path.write_text('{"id": 1, "content": "hello"}\n{"id": 2, "text": "world"}\n')  # one record lacks it
    assert main(["inspect", str(path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["documents"] == 1 and report["skipped_records"] == 1


def test_inspect_after_a_corrupt_file_is_not_exact(tmp_path, capsys):
    pytest.importorskip("zstandard")  # the [zstd] extra, as test_formats.py
    from tests.data._shards import write_jsonl_files

    write_jsonl_files(str(tmp_path), 2, 2000, zstd=True)
    path = tmp_path / "part-000001.jsonl.zst"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # truncated
    with pytest.warns(RuntimeWarning, match="truncated"):
        assert main(["inspect", str(tmp_path / "part-{000000..000001}.jsonl.zst")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["exact"] is False and report["corrupt_units"] == 1
    assert 2000 <= report["documents"] < 4000  # what was read before the damage
