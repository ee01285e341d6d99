"""The embedded dataset: the stdlib's sources as train/val shards, built once, held-out files disjoint."""

from __future__ import annotations

import json

import pytest

from megascale.data import Source, WebDataConfig, WebLoader
from megascale.data.cli import main as cli
from megascale.data.sources import iter_samples, list_shards
from megascale.data.stdlib import build_stdlib_shards, stdlib_files


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("stdlib")
    return out, build_stdlib_shards(out, val_percent=5)


def _texts(pattern: str) -> list[bytes]:
    return [s["txt"] for shard in list_shards(Source(pattern)) for s in iter_samples(shard)]


def test_every_file_lands_in_exactly_one_split(built):
    _, shards = built
    train, val = _texts(shards.train), _texts(shards.val)
    assert len(train) == shards.train_docs and len(val) == shards.val_docs
    assert shards.train_docs + shards.val_docs == len(stdlib_files())
    assert 0.02 < shards.val_docs / len(stdlib_files()) < 0.10  # about val_percent of the files
    assert not set(train) & set(val)
    assert any(b"def " in t for t in val) and any(b'"""' in t for t in train)  # real code and docstrings


def test_a_finished_build_is_reused_and_rebuilt_only_when_asked_or_changed(built):
    out, shards = built
    stamps = {p.name: p.stat().st_mtime_ns for p in out.glob("*.tar")}
    assert build_stdlib_shards(out, val_percent=5) == shards
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.tar")} == stamps
    other = build_stdlib_shards(out, val_percent=20)
    assert other.val_docs > shards.val_docs
    (out / "stdlib.json").unlink()  # an interrupted build leaves no marker: built again
    again = build_stdlib_shards(out, val_percent=5)
    assert again == shards


def test_the_loader_reads_it_and_the_cli_prints_the_patterns(built, tmp_path, capsys):
    _, shards = built
    config = WebDataConfig(sources=[Source(shards.val)], seq_len=32, batch_size=2, lanes=2)
    loader = WebLoader(config, tree=False)
    x, y = next(iter(loader))
    assert x.shape == (2, 32) and (x[:, 1:] == y[:, :-1]).all()
    assert cli(["stdlib", "--output", str(tmp_path / "cli"), "--max-docs", "200"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["train"].endswith(".tar") and printed["val_docs"] + printed["train_docs"] == len(
        stdlib_files()
    )
