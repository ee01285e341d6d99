"""Text to token ids: a byte-level tokenizer (no files, no dependencies) and Hugging Face `tokenizers` files.

Tokenizers run in lightweight worker processes started with "spawn", so this module must not import torch;
they are pickled to those workers, so each one pickles small (`HFTokenizer` sends its path, not its tables).
"""

from __future__ import annotations

import os
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer"]

EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<eos>")


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> np.ndarray:
        """1-D int32 token ids of `text`, without an end-of-sequence id."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are bytes, 256 is end-of-sequence (vocabulary of 257)."""

    vocab_size: int = 257
    eos_id: int = 256

    def encode(self, text: str) -> np.ndarray:
        """The UTF-8 bytes of `text` as int32 ids."""
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def decode(self, ids: np.ndarray | list[int]) -> str:
        """Text of byte ids (the eos id and invalid UTF-8 are dropped/replaced)."""
        data = bytes(int(i) for i in np.asarray(ids).ravel() if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A Hugging Face `tokenizers` JSON file (``tokenizer.json``).

    Args:
        path: Path to the tokenizer's JSON file.
        eos_token: The end-of-sequence token; by default the first of ``</s>``, ``<|endoftext|>``, ``<eos>``
            that the tokenizer knows.

    Raises:
        ImportError: `tokenizers` is not installed (``pip install 'megascale-data[tokenizers]'``).
        ValueError: No end-of-sequence token could be found.
    """

    def __init__(self, path: str | os.PathLike[str], eos_token: str | None = None) -> None:
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError as e:
            raise ImportError(
                "HFTokenizer needs the `tokenizers` package: pip install 'megascale-data[tokenizers]'"
            ) from e
        self.path = os.fspath(path)
        self.eos_token = eos_token
        try:
            self._tokenizer = _Tokenizer.from_file(self.path)
        except Exception as e:
            raise ValueError(f"cannot load tokenizer file {self.path}: {e}") from e
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        candidates = (eos_token,) if eos_token is not None else EOS_CANDIDATES
        ids = [(t, self._tokenizer.token_to_id(t)) for t in candidates]
        found = [(t, i) for t, i in ids if i is not None]
        if not found:
            raise ValueError(
                f"tokenizer {self.path} has no end-of-sequence token among {list(candidates)}; "
                "pass eos_token= naming one of its special tokens"
            )
        self.eos_token, self.eos_id = found[0][0], int(found[0][1])

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text` as int32, without special tokens added by post-processing."""
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int32)

    def decode(self, ids: np.ndarray | list[int]) -> str:
        """Text of token ids (special tokens skipped)."""
        return str(self._tokenizer.decode([int(i) for i in np.asarray(ids).ravel()]))

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "eos_token": self.eos_token}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["eos_token"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, eos_token={self.eos_token!r})"


def load_tokenizer(spec: str = "bytes") -> Tokenizer:
    """Build a tokenizer from a short spec.

    Args:
        spec: ``"bytes"`` for `ByteTokenizer`, or the path of a Hugging Face `tokenizers` ``.json`` file.

    Returns:
        The tokenizer.

    Raises:
        ValueError: The spec is neither ``"bytes"`` nor an existing ``.json`` file.
    """
    if spec == "bytes":
        return ByteTokenizer()
    if spec.endswith(".json") and os.path.isfile(spec):
        return HFTokenizer(spec)
    raise ValueError(
        f"unknown tokenizer {spec!r}: use 'bytes' (byte-level, vocabulary 257) or the path of an existing "
        "Hugging Face tokenizers .json file"
    )
