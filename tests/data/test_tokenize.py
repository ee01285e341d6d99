"""Tokenizers: the byte-level one, Hugging Face `tokenizers` files, and how both travel to workers."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from megascale.data.tokenize import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

CORPUS = ["hello world", "hello there world", "the world is round", "a small corpus"]


def _train(path, special_tokens: list[str]) -> str:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=80, special_tokens=special_tokens))
    tok.save(str(path))
    return str(path)


def test_byte_tokenizer_roundtrips_utf8():
    tok = load_tokenizer("bytes")
    assert isinstance(tok, ByteTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.eos_id) == (257, 256)
    text = "héllo wörld ☃ 日本 🚀"
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.ndim == 1
    assert ids.tolist() == list(text.encode("utf-8"))
    assert bytes(ids.astype(np.uint8)).decode("utf-8") == text
    assert tok.decode(np.append(ids, tok.eos_id)) == text
    assert tok.encode("").shape == (0,)
    assert pickle.loads(pickle.dumps(tok)).encode(text).tolist() == ids.tolist()


def test_hf_tokenizer_encodes_and_finds_eos(tmp_path):
    path = _train(tmp_path / "tok.json", ["<unk>", "</s>"])
    tok = load_tokenizer(path)
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert tok.eos_id == 1 and tok.eos_token == "</s>"
    assert 0 < tok.vocab_size <= 80
    ids = tok.encode("hello world")
    assert ids.dtype == np.int32 and ids.ndim == 1 and len(ids) > 0
    assert tok.eos_id not in ids.tolist()
    assert tok.decode(ids) == "hello world"


def test_hf_tokenizer_eos_choice(tmp_path):
    path = _train(tmp_path / "tok.json", ["<unk>", "<|endoftext|>", "<pad>"])
    assert HFTokenizer(path).eos_token == "<|endoftext|>"
    assert HFTokenizer(path, eos_token="<pad>").eos_id == 2
    with pytest.raises(ValueError, match="eos_token"):
        HFTokenizer(path, eos_token="<nope>")
    bare = _train(tmp_path / "bare.json", ["<unk>"])
    with pytest.raises(ValueError, match="no end-of-sequence token"):
        HFTokenizer(bare)


def test_hf_tokenizer_pickles_by_path(tmp_path):
    path = _train(tmp_path / "tok.json", ["<unk>", "</s>"])
    tok = HFTokenizer(path)
    data = pickle.dumps(tok)
    assert len(data) < 500  # the path, not the vocabulary
    clone = pickle.loads(data)
    assert (clone.vocab_size, clone.eos_id) == (tok.vocab_size, tok.eos_id)
    assert clone.encode("the round world").tolist() == tok.encode("the round world").tolist()


def test_load_tokenizer_rejects_unknown_specs(tmp_path):
    with pytest.raises(ValueError, match="'bytes'"):
        load_tokenizer("gpt2")
    with pytest.raises(ValueError, match="existing"):
        load_tokenizer(str(tmp_path / "missing.json"))


def test_missing_tokenizers_package_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(ImportError, match=r"megascale-data\[tokenizers\]"):
        HFTokenizer("whatever.json")
