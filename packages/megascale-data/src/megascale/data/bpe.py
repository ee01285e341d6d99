"""Train a byte-level BPE tokenizer on the embedded corpus (the stdlib's training split), offline.

The main job tokenizes bytes (vocabulary 257); real pretraining uses a BPE vocabulary. This trains one with
Hugging Face ``tokenizers`` on the same documents the stdlib shards hold (the validation files left out, so
validation text stays unseen), GPT-2-style byte-level (every string encodes, nothing maps to an unknown
token), with one special token, ``<|endoftext|>``, as end-of-document. The output is a directory a Hugging
Face tokenizer loader reads (``tokenizer.json`` + ``tokenizer_config.json``), and so does
``megascale.data.load_tokenizer``. Nothing is downloaded.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

__all__ = ["EOS_TOKEN", "train_stdlib_bpe"]

EOS_TOKEN = "<|endoftext|>"


def _training_documents(max_bytes: int | None, val_percent: float) -> Iterator[str]:
    from megascale.data.stdlib import _held_out, stdlib_files

    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files()
    total = 0
    for path in files:
        if _held_out(path.relative_to(root).as_posix(), val_percent):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        total += len(text.encode("utf-8"))
        yield text
        if max_bytes is not None and total >= max_bytes:
            return


def train_stdlib_bpe(
    output: str | Path, *, vocab_size: int = 4096, max_bytes: int | None = None, val_percent: float = 5.0
) -> Path:
    """Train a byte-level BPE of ``vocab_size`` ids (the end-of-document token included) on the stdlib's
    training files and write it to the directory ``output``; returns ``output``.

    Args:
        output: directory to write ``tokenizer.json`` and ``tokenizer_config.json`` into.
        vocab_size: ids in the vocabulary, at least 257 (256 byte symbols + ``<|endoftext|>``).
        max_bytes: train on the first files up to about this many bytes (None: all of them).
        val_percent: the share of files held out as validation, as the stdlib shards hold them out.
    """
    if vocab_size < 257:
        raise ValueError(
            f"vocab_size={vocab_size}: a byte-level BPE needs at least 257 ids (256 bytes + eos)"
        )
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as e:
        raise ImportError(
            "training a tokenizer needs `tokenizers`: pip install 'megascale-data[tokenizers]'"
        ) from e
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_documents(max_bytes, val_percent), trainer)
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN, "bos_token": None,
              "unk_token": None, "clean_up_tokenization_spaces": False}  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
