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


def _model_dir(tmp_path, *, tokenizer_config=None, config=None, generation_config=None):
    """A Hugging Face model directory as ``save_pretrained`` lays it out (the files the tokenizer reads)."""
    import json

    root = tmp_path / "hf"
    root.mkdir(parents=True)
    _train(root / "tokenizer.json", ["<unk>", "<s>", "</s>", "<|eot|>"])
    for name, content in (("tokenizer_config.json", tokenizer_config), ("config.json", config),
                          ("generation_config.json", generation_config)):  # fmt: skip
        if content is not None:
            (root / name).write_text(json.dumps(content))
    return root


def test_a_model_directory_ends_documents_with_the_eos_its_configs_name(tmp_path):
    # tokenizer_config.json's eos_token (an AddedToken object, as transformers writes it), agreeing with config.json
    root = _model_dir(tmp_path, tokenizer_config={"eos_token": {"content": "<|eot|>", "special": True}},
                      config={"model_type": "llama", "eos_token_id": 3})  # fmt: skip
    tok = load_tokenizer(str(root))
    assert isinstance(tok, HFTokenizer) and (tok.eos_token, tok.eos_id) == ("<|eot|>", 3)
    assert pickle.loads(pickle.dumps(tok)).eos_id == 3  # travels to reader workers by path and token
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_without_a_tokenizer_config_the_models_eos_token_id_decides(tmp_path):
    # several ids (Llama 3 instruct stops at two): the first one ends documents
    root = _model_dir(tmp_path, config={"eos_token_id": [1, 3]})
    assert load_tokenizer(str(root)).eos_id == 1
    root2 = _model_dir(tmp_path / "b", generation_config={"eos_token_id": 2}, config={"eos_token_id": 3})
    assert load_tokenizer(str(root2)).eos_id == 2  # generation_config.json first, as transformers reads it
    assert load_tokenizer(str(_model_dir(tmp_path / "c"))).eos_id == 2  # no config: "</s>" by name


def test_disagreeing_or_missing_files_are_named(tmp_path):
    root = _model_dir(tmp_path, tokenizer_config={"eos_token": "</s>"}, config={"eos_token_id": 3})
    with pytest.raises(
        ValueError, match=r"tokenizer_config.json names eos_token '</s>' \(id 2\) but .*config.json"
    ):
        load_tokenizer(str(root))
    bad = _model_dir(tmp_path / "b", config={"eos_token_id": 999})
    with pytest.raises(ValueError, match="eos_token_id 999 is not an id of"):
        load_tokenizer(str(bad))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"has no tokenizer\.json"):
        load_tokenizer(str(empty))


def test_a_bpe_trained_on_the_stdlib_encodes_any_text_exactly(tmp_path):
    pytest.importorskip("tokenizers")
    from megascale.data import train_stdlib_bpe

    out = train_stdlib_bpe(tmp_path / "bpe", vocab_size=400, max_bytes=300_000)
    tok = load_tokenizer(str(out))
    assert (tok.vocab_size, tok.eos_token, tok.eos_id) == (400, "<|endoftext|>", 0)
    text = "def f(x):\n    return x  # héllo ☃ 日本 \x00\t"  # byte-level: nothing unknown, nothing lost
    ids = tok.encode(text)
    assert tok.decode(ids) == text and tok.eos_id not in ids.tolist()
    assert len(ids) < len(text.encode()) * 0.8  # merges learned from Python sources compress them
    with pytest.raises(ValueError, match="at least 257"):
        train_stdlib_bpe(tmp_path / "x", vocab_size=100)
