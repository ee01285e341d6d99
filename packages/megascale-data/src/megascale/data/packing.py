"""From WebDataset samples to fixed-length training sequences: preprocessing and packing (no torch here).

Documents are tokenized, each followed by the end-of-sequence token, concatenated and cut into windows of
``seq_len + 1`` tokens that overlap by one (Megatron's packing: window k covers tokens [k·T, k·T + T], so
every token is a target exactly once). Packing runs per shard, so a shard's sequences depend on that shard
alone and any reader can produce them; the tail of a shard shorter than a window is dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from megascale.data.tokenize import Tokenizer

__all__ = ["Preprocess", "TextPreprocess", "pack"]

Preprocess = Callable[[dict[str, Any]], np.ndarray | None]  # evaluated here: resolvable wherever used
"""Maps one WebDataset sample (``{"__key__": ..., "txt": b"...", ...}``) to a document's token ids (1-D
integer array, without end-of-sequence), or None to skip the sample. Must be picklable (a module-level
function or an instance of a module-level class): it runs in the reader's worker processes."""


@dataclass(frozen=True)
class TextPreprocess:
    """The default preprocessing: decode ``sample[text_key]`` as UTF-8 and tokenize it."""

    tokenizer: Tokenizer
    text_key: str = "txt"

    def __call__(self, sample: dict[str, Any]) -> np.ndarray | None:
        raw = sample.get(self.text_key)
        if raw is None:
            return None
        text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes | bytearray) else str(raw)
        return self.tokenizer.encode(text)


def pack(documents: Iterable[np.ndarray], seq_len: int, eos_id: int) -> Iterator[np.ndarray]:
    """Windows of ``seq_len + 1`` int32 tokens over the documents, each document followed by ``eos_id``."""
    window = seq_len + 1
    eos = np.array([eos_id], dtype=np.int32)
    carry = np.empty(0, dtype=np.int32)
    pending: list[np.ndarray] = []
    buffered = 0
    for doc in documents:
        pending += [np.asarray(doc, dtype=np.int32), eos]
        buffered += len(doc) + 1
        if len(carry) + buffered < window:
            continue
        tokens = np.concatenate([carry, *pending])
        pending, buffered = [], 0
        start = 0
        while len(tokens) - start >= window:
            yield tokens[start : start + window].copy()
            start += seq_len  # the window's last token is the next window's first input
        carry = tokens[start:]
